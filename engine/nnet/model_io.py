"""Kaldi model files (Kaldi's Nnet::Read/Write in nnet-nnet.cc, AmNnetSimple in
am-nnet-simple.cc, TransitionModel/HmmTopology in hmm/).

- ``.raw``: ``<Nnet3>``, a newline, the network's config lines, a blank line,
  ``<NumComponents> N``, then ``<ComponentName> name <Type> ... </Type>`` for
  each component, ``</Nnet3>``.  Binary files start with ``\\0B`` and store
  tokens, numbers and matrices in binary, but the config section stays text.
- ``.mdl``: a TransitionModel followed by the AmNnetSimple (the nnet,
  ``<LeftContext>``, ``<RightContext>``, ``<Priors>`` vector).  The transition
  model is read past (its structure is checked, its bytes kept so the file can be
  written back in the same format); the priors are kept.
- A config file (the text of ``input-node ...`` lines) is accepted too.

Every failure is a ModelFormatError (or ConfigError for the config section)
naming the file and the byte offset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from engine.core.errors import ConfigError, ModelFormatError, NnetcError
from engine.nnet.kaldi_io import BINARY_HEADER, KaldiReader, KaldiWriter
from engine.nnet.nnet import Nnet

MAX_COMPONENTS = 100_000


@dataclass
class Model:
    """A network plus what a ``.mdl`` carries besides it."""

    nnet: Nnet
    priors: np.ndarray | None = None
    # The transition model's bytes exactly as read, and whether they were binary.
    transition_model: bytes | None = None
    transition_binary: bool | None = None
    left_context: int | None = None
    right_context: int | None = None
    source: str = "<model>"
    extra: dict = field(default_factory=dict)

    @property
    def is_am(self) -> bool:
        return self.transition_model is not None


# -- reading ----------------------------------------------------------------------------------


def _skip_one_char(r: KaldiReader) -> None:
    """Kaldi's ReadToken consumes the one whitespace character after a token;
    in text mode KaldiReader leaves it, so take it here."""
    if not r.binary and r.pos < len(r.data) and r.data[r.pos:r.pos + 1] in b" \t\n\r":
        r.pos += 1


def _read_config_section(r: KaldiReader) -> tuple[str, int]:
    """The text lines between ``<Nnet3>`` and the blank line; returns (text, first line no.)."""
    _skip_one_char(r)
    data = r.data
    nl = data.find(b"\n", r.pos)
    if nl < 0:
        raise r.error("unexpected end of file after <Nnet3> (expected a newline)")
    if data[r.pos:nl] not in (b"", b"\r"):
        raise r.error(f"expected a newline after <Nnet3>, got {data[r.pos:nl][:30]!r}")
    r.pos = nl + 1
    first_line = data.count(b"\n", 0, r.pos) + 1
    start = r.pos
    lines = []
    while True:
        nl = data.find(b"\n", r.pos)
        if nl < 0:
            raise r.error("unexpected end of file in the config section (no blank line "
                          "before <NumComponents>)")
        line = data[r.pos:nl]
        r.pos = nl + 1
        if line in (b"", b"\r"):
            break
        lines.append(line)
    try:
        text = b"\n".join(lines).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelFormatError("config section is not text", source=r.source,
                               offset=start + e.start) from None
    return text, first_line


def read_nnet(r: KaldiReader) -> Nnet:
    """One ``<Nnet3> ... </Nnet3>`` at the reader's position."""
    from engine.nnet.components.base import read_component  # noqa: PLC0415
    from engine.nnet.config import apply_config  # noqa: PLC0415
    r.expect_token("<Nnet3>")
    config_text, first_line = _read_config_section(r)
    config_offset = r.pos
    r.expect_token("<NumComponents>")
    start = r.pos
    num = r.read_int()
    if not 0 <= num < MAX_COMPONENTS:
        raise r.error(f"bad number of components {num}", offset=start)
    nnet = Nnet()
    for _ in range(num):
        r.expect_token("<ComponentName>")
        name_pos = r.pos
        name = r.read_token()
        if name in nnet.component_names:
            raise r.error(f"component name {name!r} appears twice", offset=name_pos)
        try:
            comp = read_component(r, name)
        except ModelFormatError:
            raise
        except (NnetcError, ValueError, IndexError, KeyError, OverflowError) as e:
            raise r.error(f"while reading component {name!r}: {e}", offset=name_pos) from None
        except RecursionError:
            raise r.error(f"component {name!r} nests sub-components too deeply",
                          offset=name_pos) from None
        nnet.components.append(comp)
        nnet.component_names.append(name)
    r.expect_token("</Nnet3>")
    _skip_one_char(r)
    # Line numbers in config errors count from the start of the file.
    padded = "\n" * (first_line - 1) + config_text
    try:
        apply_config(nnet, padded, source=r.source)
    except ConfigError as e:
        raise ConfigError(f"{e.reason} (config section ending at byte {config_offset})",
                          source=e.source, line=e.line, text=e.text) from None
    return nnet


def _skip_topology(r: KaldiReader) -> None:
    r.expect_token("<Topology>")
    if not r.binary:
        # The text form is a free-form listing; read past it to its closing token.
        while r.read_token() != "</Topology>":
            pass
        return
    r.read_int_vector()  # phones
    r.read_int_vector()  # phone2idx
    start = r.pos
    n = r.read_int()
    is_hmm = True
    if n == -1:
        is_hmm = False
        n = r.read_int()
    if not 0 <= n <= len(r.data):
        raise r.error(f"bad number of topology entries {n}", offset=start)
    for _ in range(n):
        start = r.pos
        states = r.read_int()
        if not 0 <= states <= len(r.data):
            raise r.error(f"bad number of HMM states {states}", offset=start)
        for _ in range(states):
            r.read_int()
            if not is_hmm:
                r.read_int()
            start = r.pos
            ntrans = r.read_int()
            if not 0 <= ntrans <= len(r.data):
                raise r.error(f"bad number of transitions {ntrans}", offset=start)
            for _ in range(ntrans):
                r.read_int()
                r.read_float()
    r.expect_token("</Topology>")


def skip_transition_model(r: KaldiReader) -> None:
    r.expect_token("<TransitionModel>")
    _skip_topology(r)
    start = r.pos
    tok = r.read_token()
    if tok not in ("<Triples>", "<Tuples>"):
        raise r.error(f"expected <Triples> or <Tuples>, got {tok!r}", offset=start)
    start = r.pos
    n = r.read_int()
    if not 0 <= n <= len(r.data):
        raise r.error(f"bad number of transition tuples {n}", offset=start)
    per = 4 if tok == "<Tuples>" else 3
    for _ in range(n * per):
        r.read_int()
    start = r.pos
    close = r.read_token()
    if close not in ("</Triples>", "</Tuples>"):
        raise r.error(f"expected </Triples> or </Tuples>, got {close!r}", offset=start)
    r.expect_token("<LogProbs>")
    r.read_vector()
    r.expect_token("</LogProbs>")
    r.expect_token("</TransitionModel>")
    if not r.binary:
        # keep the text layout's line break with the transition model's bytes
        while r.pos < len(r.data) and r.data[r.pos:r.pos + 1] in b" \t\r":
            r.pos += 1
        if r.data[r.pos:r.pos + 1] == b"\n":
            r.pos += 1


def _read_model(data: bytes, source: str) -> Model:
    binary = data[:2] == BINARY_HEADER
    r = KaldiReader(data, binary=None, source=source)
    if r.at_eof():
        raise ModelFormatError("empty model file", source=source, offset=0)
    first = r.peek_token()
    if first == "<TransitionModel>":
        tm_start = r.pos
        skip_transition_model(r)
        tm_bytes = data[tm_start:r.pos]
        nnet = read_nnet(r)
        r.expect_token("<LeftContext>")
        left = r.read_int()
        r.expect_token("<RightContext>")
        right = r.read_int()
        r.expect_token("<Priors>")
        priors = r.read_vector()
        model = Model(nnet, priors if priors.size else None, tm_bytes, binary, left, right,
                      source)
    elif first == "<Nnet3>":
        model = Model(read_nnet(r), source=source)
    else:
        raise r.error(f"not a Kaldi nnet3 model: starts with {first[:40]!r} (expected "
                      f"<Nnet3> or <TransitionModel>)")
    if not r.at_eof():
        raise r.error("unexpected data after the end of the model")
    return model


def _looks_like_config(data: bytes) -> bool:
    head = data.lstrip()[:200]
    return not head.startswith(b"<") and not data.startswith(BINARY_HEADER)


def load_model(path_or_bytes, source: str | None = None) -> Model:
    """Load a config file, a text or binary ``.raw``, or a ``.mdl``.

    ``path_or_bytes`` is a path (str or PathLike) or the file's content (bytes).
    """
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        data = bytes(path_or_bytes)
        src = source or "<model>"
    else:
        src = source or os.fspath(path_or_bytes)
        try:
            with open(path_or_bytes, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ModelFormatError(f"cannot read file: {e.strerror}", source=src) from None
    if _looks_like_config(data):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFormatError("neither a Kaldi model nor a UTF-8 config file",
                                   source=src, offset=e.start) from None
        from engine.nnet.config import apply_config  # noqa: PLC0415
        nnet = Nnet()
        apply_config(nnet, text, source=src)
        return Model(nnet, source=src)
    try:
        return _read_model(data, src)
    except RecursionError:
        raise ModelFormatError("model nested too deeply", source=src) from None
    except (MemoryError, OverflowError) as e:
        raise ModelFormatError(f"model sizes out of range: {e}", source=src) from None


def load_nnet(path_or_bytes, source: str | None = None) -> Nnet:
    return load_model(path_or_bytes, source).nnet


# -- writing ----------------------------------------------------------------------------------


def write_nnet(nnet: Nnet, w: KaldiWriter) -> None:
    """Kaldi's Nnet::Write (the config section is text in both modes)."""
    w.write_token("<Nnet3>")
    w.raw("\n")
    for line in nnet.config_lines():
        w.raw(line + "\n")
    w.raw("\n")
    w.write_token("<NumComponents>")
    w.write_int(len(nnet.components))
    if not w.binary:
        w.raw("\n")
    for name, comp in zip(nnet.component_names, nnet.components):
        w.write_token("<ComponentName>")
        w.write_token(name)
        comp.write(w)
        if not w.binary:
            w.raw("\n")
    w.write_token("</Nnet3>")


def nnet_to_bytes(nnet: Nnet, binary: bool) -> bytes:
    w = KaldiWriter(binary=binary, header=True)
    write_nnet(nnet, w)
    return w.getvalue()


def model_to_bytes(model: Model, binary: bool, as_am: bool | None = None) -> bytes:
    """The model as Kaldi writes it: a raw nnet, or (``as_am``, default: when
    it came from a .mdl) transition model + nnet + contexts + priors."""
    if as_am is None:
        as_am = model.is_am
    if not as_am:
        return nnet_to_bytes(model.nnet, binary)
    if model.transition_model is None:
        raise ModelFormatError("cannot write a .mdl: the model has no transition model",
                               source=model.source)
    if model.transition_binary != binary:
        raise ModelFormatError(
            f"cannot write the transition model in {'binary' if binary else 'text'} form: it "
            f"was read in {'binary' if model.transition_binary else 'text'} form and is kept "
            f"as bytes (write a raw nnet instead)", source=model.source)
    from engine.nnet.graph import compute_simple_context, is_simple_nnet  # noqa: PLC0415
    w = KaldiWriter(binary=binary, header=True)
    w.raw(model.transition_model)
    write_nnet(model.nnet, w)
    left, right = model.left_context, model.right_context
    if is_simple_nnet(model.nnet):
        # Kaldi's AmNnetSimple recomputes the context (SetContext) rather than trusting it.
        left, right = compute_simple_context(model.nnet)
    w.write_token("<LeftContext>")
    w.write_int(left or 0)
    w.write_token("<RightContext>")
    w.write_int(right or 0)
    w.write_token("<Priors>")
    w.write_vector(model.priors if model.priors is not None else np.zeros(0, np.float32))
    return w.getvalue()


def save_model(model: Model | Nnet, path, binary: bool = True, as_am: bool | None = None) -> None:
    if isinstance(model, Nnet):
        model = Model(model)
    data = model_to_bytes(model, binary, as_am)
    with open(path, "wb") as f:
        f.write(data)
