"""titan_core: a PyTorch-native LLM pre-training engine (Llama 3, DCP, 4D parallelism)."""

__version__ = "0.1.0"
