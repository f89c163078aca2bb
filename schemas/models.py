"""Model registration and model info."""

from __future__ import annotations

from pydantic import Field, model_validator

from schemas.common import Int, Strict


class RegisterModelRequest(Strict):
    """Exactly one of ``config`` (Kaldi config text: input-node/component/... lines),
    ``text`` (a Kaldi text model, .raw or .mdl) or ``binary_b64`` (a binary model,
    base64)."""

    config: str | None = None
    text: str | None = None
    binary_b64: str | None = None
    name: str | None = Field(default=None, max_length=200,
                             description="a label for listings; not part of the id")
    seed: Int | None = Field(default=None, ge=0,
                             description="seed for the random initial parameters of a config "
                                         "(0 when absent)")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("config", "text", "binary_b64") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of config, text, binary_b64 "
                             f"(got {', '.join(given) or 'none'})")
        return self


class ModelInfo(Strict):
    """The figures of ``nnetc info`` (Kaldi's nnet3-info)."""

    left_context: int | None = None
    right_context: int | None = None
    modulus: int
    num_parameters: int
    input_dims: dict[str, int]
    output_dims: dict[str, int]
    num_components: int
    component_types: dict[str, int]
    num_priors: int | None = None
    streaming: str | None = Field(default=None, description="whether /streams can run the "
                                  "network: 'yes', or what it takes and why")


class ModelResponse(Strict):
    model_id: str = Field(description="sha256 of the model's bytes as registered")
    structure_hash: str = Field(description="sha256 of the network's structure (its "
                                            "parameter values left out); part of cache keys")
    name: str | None = None
    created: bool = Field(description="false when the model was registered before")
    info: ModelInfo


class ModelList(Strict):
    models: list[ModelResponse]
