"""Command-line pieces the scripts share: logging, the help formatter, and the model and engine
flags (declared beside what they set: builder.py, engine/settings.py) with building an engine
from them."""

from __future__ import annotations

import argparse
import logging

from laps_jax import builder
from laps_jax.builder import BuiltEngine, describe_engine, warm_up  # noqa: F401 (scripts)
from laps_jax.config import EngineConfig, builtin_model_dir  # noqa: F401 (scripts use it)
from laps_jax.engine import settings

DEFAULT_MODEL = "builtin"


def setup_logging() -> None:
    """Library warnings print as `WARNING name: message`, not as bare lines."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default once. A help text that ends in "(default: ...)" explains a
    `None` default; where a script sets a real default instead, that value replaces it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS \
                or isinstance(action.default, bool) or "%(default)" in text:
            return text
        if text.endswith(")") and "(default: " in text:
            text = text[:text.rindex("(default: ")].rstrip()
        return text + " (default: %(default)s)"


def add_engine_args(ap: argparse.ArgumentParser, default_model: str | None = DEFAULT_MODEL):
    """The "model and engine" flags (None `default_model`: --model is required)."""
    g = ap.add_argument_group("model and engine")
    builder.add_args(g, default_model)
    settings.add_args(g)
    return g


def engine_config_from_args(args) -> EngineConfig:
    """The engine settings the flags ask for, made concrete for --model's config (read from
    config.json alone: no weights are loaded). Raises SettingsError (one line) for settings
    that cannot work together."""
    from laps_jax.config import resolve_model
    return settings.resolve(settings.from_args(args), resolve_model(args.model)[0])


def build_engine(args, prompt_logprobs: bool = False, warmup: bool = True,
                 log=builder.log_to_stderr, **fields) -> BuiltEngine:
    """Checks the settings, loads the model and tokenizer, builds the engine (`fields`: more
    of `EngineBuild`, e.g. engines=2) and (with `warmup`) compiles every bucket and runs each
    once."""
    return builder.build(builder.from_args(args, **fields), warmup=warmup,
                         prompt_logprobs=prompt_logprobs, log=log)
