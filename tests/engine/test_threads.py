"""What engine/README.md ("Inference and streaming", Threads) says may be shared between
threads: an Inferencer called from two threads at once, and compile_request on one
network from two threads, give what they give called one at a time.  (Streams from
threads: test_streaming.py; the pool from threads: test_buffer_pool.py.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engine.compiler.request import ComputationRequest, IoSpecification
from engine.compiler.shortcut import compile_request
from engine.core.index import Index
from engine.core.memo import clear_request_memos
from engine.inference import InferenceOptions, Inferencer
from inference_nets import RECURRENT, TDNN_IVECTOR, feats, make_nnet


def test_an_inferencer_called_from_two_threads_at_once():
    for config in (RECURRENT, TDNN_IVECTOR):
        nnet = make_nnet(config)
        inf = Inferencer(nnet, InferenceOptions(frames_per_chunk=13))
        xs = [feats(60 + 17 * j, seed=40 + j) for j in range(8)]
        ivs = [feats(1, 4, seed=60 + j)[0] if "ivector" in nnet.input_names() else None
               for j in range(8)]
        want = [inf.infer(x, iv) for x, iv in zip(xs, ivs)]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(inf.infer, xs, ivs))
        for j, (a, b) in enumerate(zip(got, want)):
            assert np.array_equal(a, b), f"utterance {j}"


def test_compile_request_from_two_threads_at_once():
    nnet = make_nnet(RECURRENT)

    def request(frames: int, n: int) -> ComputationRequest:
        return ComputationRequest(
            [IoSpecification("input", [Index(i, t, 0) for i in range(n)
                                       for t in range(-2, frames + 3)])],
            [IoSpecification("output", [Index(i, t, 0) for i in range(n)
                                        for t in range(frames)])])

    reqs = [request(f, n) for f in (5, 9, 14, 20, 31) for n in (1, 2, 3)]
    want = [compile_request(nnet, r).to_text(nnet) for r in reqs]
    clear_request_memos()
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda r: compile_request(nnet, r).to_text(nnet), reqs))
    assert got == want
