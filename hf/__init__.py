"""Hugging Face checkpoints in and out: ``config.json`` <-> ``ModelConfig``, a sharded
streaming load straight onto a mesh, and an export ``transformers`` loads unchanged.
See docs/hf.md.

    >>> from triax.hf import ARCHITECTURES
    >>> ARCHITECTURES
    ('LlamaForCausalLM', 'MistralForCausalLM', 'MixtralForCausalLM')
"""
from triax.hf.config import ARCHITECTURES, hf_config, model_config, read_config
from triax.hf.files import Checkpoint, HFError
from triax.hf.load import LoadReport, load, load_params, read_model_config, tensor_placement

__all__ = ["ARCHITECTURES", "Checkpoint", "HFError", "LoadReport", "hf_config", "load",
           "load_params", "model_config", "read_config", "read_model_config",
           "tensor_placement"]
