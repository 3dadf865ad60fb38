"""Integrations with other training stacks (optional extras): `hetero.integrations.transformers.HeteroTrainer`."""
