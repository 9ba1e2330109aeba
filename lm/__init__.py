"""Decoder LMs built from mixes of attention head types: config, model, training, generation."""
from lm.config import Config, ModelConfig
from lm.config_io import load_config
from lm.model import DecoderLM, build_model

__all__ = ["Config", "DecoderLM", "ModelConfig", "build_model", "load_config"]
