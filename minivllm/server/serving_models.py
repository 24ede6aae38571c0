"""GET /v1/models and /v1/models/{id}: the one model this server serves, under its served name."""
from minivllm.server.protocol import now
from minivllm.server.serving_engine import OpenAIServing


class OpenAIServingModels(OpenAIServing):
    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": now(), "owned_by": "minivllm",
                "max_model_len": self.max_model_len}

    def show_available_models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def show_model(self, model_id: str) -> dict:
        self.check_model(model_id)
        return self.model_card()
