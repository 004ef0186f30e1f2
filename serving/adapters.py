"""Many LoRA adapters over HTTP: a request's ``model`` names the base or a loaded adapter,
``GET /v1/models`` lists them all, and vLLM's ``POST /v1/load_lora_adapter`` /
``POST /v1/unload_lora_adapter`` load and unload adapters while the server serves
(``inference.adapter_serving``; the engines' tables keep their shapes, so nothing
recompiles). They are off unless ``triax serve --allow-adapter-updates`` (403): a client
then names directories the server process reads. A server started without a table (no
``--adapter NAME=DIR``, no ``--max-adapters``) answers them 400, naming the flags.
"""
from __future__ import annotations

import asyncio
from typing import Optional

from fastapi.responses import PlainTextResponse

from triax.inference.adapter_table import AdapterNotFound
from triax.inference.errors import InferenceError
from triax.serving.errors import APIError
from triax.serving.protocol import _Strict


class LoadLoraRequest(_Strict):
    """vLLM's ``/v1/load_lora_adapter`` body: the new model's name and its PEFT directory."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(_Strict):
    """vLLM's ``/v1/unload_lora_adapter`` body."""

    lora_name: str


def resolve(st, model: Optional[str]) -> Optional[str]:
    """The adapter a request's ``model`` names (None: the base); any other name is a 404
    naming the models served."""
    if model is None or model == st.model_name:
        return None
    if model in st.server.adapter_names:
        return model
    served = ", ".join(repr(m) for m in [st.model_name, *st.server.adapter_names])
    raise APIError(404, f"model {model!r} is not served here; this server serves {served} "
                        f"(GET /v1/models)", param="model", code="model_not_found")


def model_cards(st) -> list[dict]:
    """``/v1/models``' entries: the base, then each adapter (``parent``: the base, ``root``:
    its directory, as vLLM lists them)."""
    card = {"object": "model", "created": 0, "owned_by": "triax", "max_model_len": st.max_len}
    return [{"id": st.model_name, "root": st.model_name, "parent": None, **card}] + [
        {"id": name, "root": directory, "parent": st.model_name, **card}
        for name, directory in st.server.adapter_dirs().items()]


def install(app, st, updates: bool = False) -> None:
    """The two adapter endpoints, answered when ``updates`` (else 403 naming
    ``--allow-adapter-updates``); an adapter named as the base could never be reached: a
    ``ValueError`` naming ``--served-model-name``."""
    if st.model_name in st.server.adapter_names:
        raise ValueError(f"--adapter {st.model_name}=...: the base is served as "
                         f"{st.model_name!r} too; rename the adapter or give "
                         f"--served-model-name")
    def allowed():
        if not updates:
            raise APIError(403, "adapter loading and unloading are off: start triax serve "
                                "with --allow-adapter-updates (clients then name directories "
                                "the server reads)", code="adapter_updates_off")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraRequest):
        allowed()
        if req.lora_name == st.model_name:
            raise APIError(400, f"lora_name {req.lora_name!r} is the base model's name; "
                                f"choose another", param="lora_name", code="invalid_value")
        try:
            await asyncio.to_thread(st.server.load_adapter, req.lora_name, req.lora_path)
        except InferenceError as e:
            raise APIError(400, str(e), param="lora_path", code="invalid_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added "
                                 f"successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraRequest):
        allowed()
        try:
            st.server.unload_adapter(req.lora_name)
        except AdapterNotFound as e:
            raise APIError(404, str(e), param="lora_name", code="model_not_found") from None
        except InferenceError as e:
            raise APIError(400, str(e), param="lora_name", code="adapter_in_use") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed "
                                 f"successfully.")
