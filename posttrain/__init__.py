"""posttrain: LLM post-training in one coherent, readable package."""

__version__ = "0.1.0"
