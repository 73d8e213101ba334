"""config.json against the checkpoint's tensors, from the headers alone, before any weight is
read.

Without it a config with fewer layers than the checkpoint loads as a smaller model (the extra
tensors were never asked for), and a config with absurd sizes allocates before any shape is
compared. Each error is one line naming the config field and both files.
"""

from __future__ import annotations

import re

from laps_jax.config import ConfigError, ModelConfig
from laps_jax.models.safetensors_io import CheckpointError, SafetensorsCheckpoint
from laps_jax.models.weights import DIMS, expected_tensors, shape_of

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class ConfigMismatchError(ConfigError, CheckpointError):
    """config.json and the tensors disagree; either file may be the wrong one, so callers
    catching either kind of error see it."""


def _check_layer_count(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, cfg_path: str) -> None:
    layers: dict[int, str] = {}  # layer index -> one of its tensor names
    for name in ckpt.names():
        m = _LAYER.match(name)
        if m:
            layers.setdefault(int(m.group(1)), name)
    held = max(layers) + 1 if layers else 0
    if held > cfg.num_layers:
        raise ConfigMismatchError(
            f"{cfg_path}: num_hidden_layers is {cfg.num_layers} but the checkpoint has "
            f"{held} layers ({layers[held - 1]} is in {ckpt.file_of(layers[held - 1])})")
    if held < cfg.num_layers:
        raise ConfigMismatchError(
            f"{cfg_path}: num_hidden_layers is {cfg.num_layers} but the checkpoint in "
            f"{ckpt.path} has {held} layers (no model.layers.{held}.* tensors)")


def check_checkpoint(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, cfg_path: str) -> None:
    """Refuses a layer count or a tensor shape that config.json does not imply. A missing
    tensor is left to the loader, which names it (except an lm_head that
    tie_word_embeddings=false asks for)."""
    _check_layer_count(ckpt, cfg, cfg_path)
    if not cfg.tie_word_embeddings and not ckpt.has("lm_head.weight"):
        raise ConfigMismatchError(
            f"{cfg_path}: tie_word_embeddings is false but the checkpoint in {ckpt.path} has "
            "no lm_head.weight (a tied model sets it true)")
    for name, dims in expected_tensors(cfg):
        if not ckpt.has(name):
            continue
        got, want = tuple(ckpt.shape(name)), shape_of(cfg, dims)
        if got == want:
            continue
        field = next((d for d, g, w in zip(dims, got, want) if g != w), dims[0])
        raise ConfigMismatchError(
            f"{cfg_path}: {field} is {DIMS[field](cfg)} but tensor {name!r} in "
            f"{ckpt.file_of(name)} has shape {got}, expected {want} = ({', '.join(dims)})")
