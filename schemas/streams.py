"""Streams: online inference with the network's state carried from one piece of
input to the next (Kaldi's looped decodable, engine.inference.stream)."""

from __future__ import annotations

from pydantic import Field

from schemas.common import Bool, Float, Int, Matrix, MatrixEncoding, Strict, Vector


class StreamOptions(Strict):
    """Kaldi's NnetSimpleLoopedComputationOptions, plus what is applied to the output."""

    frames_per_chunk: Int = Field(default=20, ge=1, description="rounded up to the network's "
                                  "modulus and the frame subsampling factor")
    extra_left_context_initial: Int = Field(default=0, ge=0)
    frame_subsampling_factor: Int = Field(default=1, ge=1)
    acoustic_scale: Float = Field(default=1.0, description="the output is multiplied by it")
    use_priors: Bool = Field(default=False, description="subtract the log priors of a .mdl "
                                                        "model from the output")
    truncate_future_recurrence: Bool = Field(
        default=False, description="stream a network with a recurrence reading later frames "
        "(a BLSTM's backward half) as Kaldi's looped decodable does, that recurrence cut at "
        "each chunk's end (the output then depends on frames_per_chunk); without it such a "
        "network is refused")


class OpenStreamRequest(Strict):
    model_id: str
    options: StreamOptions = Field(default_factory=StreamOptions)
    ivector: Vector | None = Field(default=None, description="the stream's i-vector, for "
                                   "networks with an 'ivector' input")
    online_ivector_period: Int | None = Field(
        default=None, ge=1, description="instead of an i-vector: online i-vector rows, one per "
        "this many input frames, pushed with the frames (PushRequest.online_ivectors); each "
        "chunk reads the row of its last input frame, as Kaldi's looped decodable with an "
        "online i-vector matrix, and waits for it unless the stream is finished")


class StreamInfo(Strict):
    stream_id: str
    model_id: str
    options: StreamOptions
    chunk_size: int = Field(description="input frames per computed chunk")
    left_context: int
    right_context: int
    input_dim: int
    output_dim: int
    frames_received: int
    frames_output: int = Field(description="output rows returned so far (subsampled frames)")
    finished: bool
    online_ivector_period: int | None = Field(default=None, description="set when the stream "
                                              "takes online i-vector rows")
    ivector_rows_received: int = Field(default=0, description="online i-vector rows pushed "
                                       "so far")
    truncated_recurrence: str | None = Field(default=None, description="with "
                                             "truncate_future_recurrence: the recurrence cut at "
                                             "each chunk's end")


class PushRequest(Strict):
    features: Matrix = Field(description="the next feature frames, any number of rows")
    ivector: Vector | None = Field(default=None, description="replaces the stream's i-vector "
                                   "for the chunks computed from now on")
    online_ivectors: Matrix | None = Field(default=None, description="the next rows of an "
                                           "online stream's i-vector matrix (row r: input "
                                           "frames up to r * online_ivector_period)")
    offset: Int | None = Field(default=None, ge=0, description="frames sent before these "
                               "(optional): a push whose offset is not the number of frames "
                               "the stream has received gets 409, so a retried push is never "
                               "counted twice")
    encoding: MatrixEncoding = "auto"


class FinishRequest(Strict):
    encoding: MatrixEncoding = "auto"


class StreamOutput(Strict):
    output: Matrix = Field(description="output rows that became computable (possibly none)")
    first_frame: int = Field(description="index of the first of these rows among the "
                                         "stream's output frames")
    frames_received: int
    frames_output: int
    finished: bool
