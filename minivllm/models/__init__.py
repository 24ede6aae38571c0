"""Model families and the registry that maps checkpoints to them."""
from minivllm.models.registry import MODEL_REGISTRY, get_model_class

__all__ = ["MODEL_REGISTRY", "get_model_class"]
