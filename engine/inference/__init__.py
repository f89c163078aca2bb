"""Inference front-end: whole-utterance decoding (Kaldi's DecodableNnetSimple /
nnet3-compute, batched like NnetBatchComputer) and looped streaming
(CompileLooped + DecodableNnetSimpleLooped) with exportable state."""

from engine.inference.batch import StreamBatcher, batch_plan
from engine.inference.looped import LoopedConfig
from engine.inference.simple import InferenceOptions, Inferencer, Utterance, infer
from engine.inference.stream import LoopedModel, Stream, StreamBatch

__all__ = ["InferenceOptions", "Inferencer", "Utterance", "infer", "LoopedConfig", "LoopedModel",
           "Stream", "StreamBatch", "StreamBatcher", "batch_plan"]
