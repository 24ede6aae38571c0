"""GET /v1/models and /v1/models/{id}: the one model this server serves, under its served name."""
from minivllm.server.protocol import now
from minivllm.server.serving_engine import OpenAIServing


class OpenAIServingModels(OpenAIServing):
    def model_card(self, name: str) -> dict:
        """vLLM's card: ``root`` is the model as the operator gave it (vLLM's benchmark loads the
        tokenizer from it when it is not told the model), ``parent`` is None (no LoRA adapters)."""
        return {"id": name, "object": "model", "created": now(), "owned_by": "minivllm",
                "root": self.config.model_root or self.model_name, "parent": None, "max_model_len": self.max_model_len}

    def show_available_models(self) -> dict:
        """A card per served name, the first the server's own (as vLLM lists them)."""
        return {"object": "list", "data": [self.model_card(name) for name in self.model_names]}

    def show_model(self, model_id: str) -> dict:
        self.check_model(model_id)
        return self.model_card(model_id)
