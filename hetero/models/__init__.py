"""Small reference models used by hetero's tests, benchmarks and examples."""

from hetero.models.gpt import GPT, GPTConfig, GPTOutput, generate_greedy

__all__ = ["GPT", "GPTConfig", "GPTOutput", "generate_greedy"]
