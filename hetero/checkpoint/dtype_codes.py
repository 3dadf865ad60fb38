"""The safetensors format's names of the dtypes a checkpoint stores (format.py writes and parses them)."""

from __future__ import annotations

import torch

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
