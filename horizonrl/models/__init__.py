"""Building and loading policies and tokenizers, and LoRA adapters."""
