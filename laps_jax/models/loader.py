"""Load a model from a preset (random weights) or a Hugging Face Qwen2 directory, and save /
restore converted weights with orbax-checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from laps_jax.config import ModelConfig, resolve_model
from laps_jax.models.checkpoint_match import check_checkpoint
from laps_jax.models.qwen2 import init_params
from laps_jax.models.safetensors_io import CheckpointError, SafetensorsCheckpoint
from laps_jax.models.weights import WeightError, params_from_hf

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def parse_dtype(name: str):
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    params: dict
    model_dir: str | None  # None for a preset (random weights, no tokenizer)
    dtype: object


def load_hf_params(model_dir: str, cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """Reads every tensor from safetensors; errors name the file or tensor at fault (and the
    config.json field when the two disagree)."""
    ckpt = SafetensorsCheckpoint(model_dir)
    check_checkpoint(ckpt, cfg, os.path.join(model_dir, "config.json"))

    def get(name: str) -> np.ndarray:
        try:
            return ckpt.get(name)
        except CheckpointError:
            raise
        except Exception as e:  # a corrupt file surfaces here, name it
            raise CheckpointError(f"{ckpt.file_of(name)}: cannot read tensor {name!r}: {e}")

    try:
        return params_from_hf(get, ckpt.has, cfg, dtype)
    except WeightError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None


def load_model(spec: str, dtype: str = "float32", seed: int = 0) -> LoadedModel:
    """`spec` is a preset name or a model directory (config.json + *.safetensors)."""
    jdtype = parse_dtype(dtype)
    cfg, model_dir = resolve_model(spec)
    if model_dir is None:
        params = init_params(cfg, jdtype, seed)
    elif os.path.isdir(os.path.join(model_dir, "orbax")):
        params = restore_params(os.path.join(model_dir, "orbax"), cfg, jdtype)
    else:
        params = load_hf_params(model_dir, cfg, jdtype)
    return LoadedModel(cfg, params, model_dir, jdtype)


def save_params(params: dict, cfg: ModelConfig, path: str) -> None:
    """Saves converted weights with orbax (plus config.json beside them)."""
    import orbax.checkpoint as ocp
    path = os.path.abspath(path)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params, force=True)
    with open(os.path.join(path, "laps_config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=1)


def restore_params(path: str, cfg: ModelConfig, dtype=jnp.float32, shardings=None) -> dict:
    """Restores weights saved by `save_params`, cast to `dtype`, placed per `shardings`."""
    import orbax.checkpoint as ocp
    from laps_jax.models.qwen2 import abstract_state
    from flax import nnx
    abstract = nnx.to_pure_dict(abstract_state(cfg, dtype))
    if shardings is not None:
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract, shardings)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.abspath(path), abstract)
