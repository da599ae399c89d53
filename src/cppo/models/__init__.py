"""The shipped tiny model and loading of any transformers causal LM."""

from cppo.models.loading import (EMBEDDED_DIR, load_model, load_tokenizer, ready_for_generation,
                                 tiny_model_config)

__all__ = ["EMBEDDED_DIR", "load_model", "load_tokenizer", "ready_for_generation",
           "tiny_model_config"]
