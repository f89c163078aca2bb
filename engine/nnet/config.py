"""The network config language (Kaldi's Nnet::ReadConfig in nnet-nnet.cc,
ReadConfigLines / ConfigLine::ParseLine in util/text-utils.cc).

A config is a list of lines ``input-node``, ``component``, ``component-node``,
``dim-range-node`` and ``output-node``; ``#`` starts a comment and a trailing
backslash continues a line.  Applying a config to an existing network works as
``nnet3-init existing.raw new.config``: the existing network is turned back into
config lines, the new lines are appended, a node defined again replaces the old
definition (and moves to where the new line puts it), and everything is re-read
in two passes (node names first, then descriptors), so lines may refer to nodes
defined later.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from dataclasses import dataclass

import numpy as np

from engine.core.errors import ConfigError
from engine.nnet.config_line import ConfigLine
from engine.nnet.descriptor_parse import DescriptorNames, is_valid_name, parse_descriptor
from engine.nnet.nnet import NetworkNode, Nnet, NodeType, ObjectiveType

_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")
EXISTING = "<existing network>"

# Options whose value is the name of a file that the component reads (Kaldi's
# ReadKaldiObject): matrix= of the affine and convolution components, vector=, scales=
# and bias= of the per-element scale/offset and fixed vector components.  Matched
# anywhere in a component line, so also inside a CompositeComponent's sub-configs.
_FILE_OPTION_RE = re.compile(r"(?:^|[\s'\"])(matrix|vector|scales|bias)=")
_files_allowed: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "nnetc_config_files_allowed", default=True)


@contextlib.contextmanager
def no_file_options():
    """Inside, a component line that names a file to read (matrix=, vector=, scales=,
    bias=) is a ConfigError: for configs and models that come from someone who must not
    have this machine's files read (a service's clients)."""
    token = _files_allowed.set(False)
    try:
        yield
    finally:
        _files_allowed.reset(token)


@dataclass
class SourceLine:
    text: str
    source: str | None
    line: int | None


def read_config_lines(text: str, source: str | None = None) -> list[SourceLine]:
    """Non-empty lines with comments and surrounding blanks removed, continued
    lines joined; each keeps the number of the line where it started."""
    out: list[SourceLine] = []
    pending = ""
    start = 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0]
        if not pending:
            start = lineno
        else:
            line = line.lstrip(" \t")
        stripped = line.rstrip(" \t\r")
        if stripped.endswith("\\") and "#" not in raw:
            pending += stripped[:-1].rstrip(" \t") + " "
            continue
        full = (pending + line).strip(" \t\r")
        pending = ""
        if full:
            out.append(SourceLine(full, source, start))
    if pending.strip():
        out.append(SourceLine(pending.strip(), source, start))
    return out


def parse_config_line(text: str, source: str | None = None,
                      line: int | None = None) -> ConfigLine:
    """Split one line like Kaldi's ConfigLine::ParseLine: values may contain
    spaces (``input=Offset(a, -1)``) up to the blank before the next ``key=``;
    ``key='quoted value'`` and ``key="quoted value"`` are accepted."""
    def err(msg: str) -> ConfigError:
        return ConfigError(msg, source=source, line=line, text=text)

    s = text
    n = len(s)
    pos = 0
    while pos < n and s[pos].isspace():
        pos += 1
    first_start = pos
    while pos < n and not s[pos].isspace():
        if s[pos] == "=":
            pos = first_start
            break
        pos += 1
    first = s[first_start:pos]
    if first and not is_valid_name(first):
        raise err(f"invalid first token {first!r}")
    values: dict[str, str] = {}
    while pos < n:
        if s[pos].isspace():
            pos += 1
            continue
        eq = s.find("=", pos)
        if eq <= pos:
            raise err(f"expected key=value at character {pos}, got {s[pos:pos + 20]!r}")
        key = s[pos:eq]
        if not _KEY_RE.match(key):
            raise err(f"invalid option name {key!r}")
        if key in values:
            raise err(f"option {key}= given twice")
        if eq + 1 < n and s[eq + 1] in "'\"":
            q = s[eq + 1]
            end = s.find(q, eq + 2)
            if end < 0:
                raise err(f"no matching quote {q} for option {key}")
            values[key] = s[eq + 2:end]
            pos = end + 1
            continue
        nxt = s.find("=", eq + 1)
        term = n
        if nxt >= 0:
            sp = max(s.rfind(" ", 0, nxt), s.rfind("\t", 0, nxt))
            if sp > eq:
                term = sp
        while term > eq + 1 and s[term - 1].isspace():
            term -= 1
        values[key] = s[eq + 1:term]
        pos = term
    return ConfigLine.from_parts(first, values, text=text, source=source, line=line)


def _get_int(cfg: ConfigLine, key: str) -> int:
    n = cfg.get_int(key)
    if n is None:
        raise cfg.error(f"expected {key}=<integer>")
    return n


def _require(cfg: ConfigLine, key: str, what: str) -> str:
    v = cfg.get_str(key)
    if v is None:
        raise cfg.error(f"expected {key}=<{what}>")
    return v


def _check_unused(cfg: ConfigLine) -> None:
    extra = cfg.unused()
    if extra:
        raise cfg.error("unknown option(s): " + " ".join(f"{k}={cfg.values[k]}" for k in extra))


def _remove_redundant(lines: list[ConfigLine], num_initial: int) -> list[ConfigLine]:
    """Drop node lines of the existing network that the new config redefines;
    names repeated within the new config are errors."""
    last_line: dict[str, int] = {}
    comp_names: set[str] = set()
    remove = [False] * len(lines)
    for i, cfg in enumerate(lines):
        name = cfg.values.get("name")
        if name is None:
            raise cfg.error("expected name=<name>")
        if not is_valid_name(name):
            raise cfg.error(f"name {name!r} is not allowed (letters, digits, '_', '-', '.'; "
                            f"starting with a letter or '_')")
        if cfg.first_token == "component":
            if name in comp_names:
                raise cfg.error(f"component name {name} appears twice in the same config")
            comp_names.add(name)
            continue
        prev = last_line.get(name)
        if prev is not None:
            if prev >= num_initial:
                raise cfg.error(f"node name {name} appears twice in the same config "
                                f"(first at line {lines[prev].line})")
            remove[prev] = True
        last_line[name] = i
    return [c for c, r in zip(lines, remove) if not r]


def _fresh_line(cfg: ConfigLine) -> ConfigLine:
    """A copy of ``cfg`` with none of its options marked used (a component line is
    read twice: counted, then drawn)."""
    return ConfigLine.from_parts(cfg.first_token, cfg.values, text=cfg.text,
                                 source=cfg.source, line=cfg.line)


def apply_config(nnet: Nnet, text: str, source: str | None = None, rng=None,
                 check=None) -> None:
    """Add the lines of ``text`` to ``nnet`` (Kaldi's Nnet::ReadConfig), then validate.

    Nothing random is drawn before the whole config has passed its checks: the
    components are first initialised without drawing (``_param_utils.planning``: their
    random arrays are counted and hold no memory), their parameters counted against
    MAX_CONFIG_PARAMETERS (or a caller's parameter_budget) for the whole config (a
    ConfigError naming the first component line beyond), the nodes read and the
    network validated (dimensions) with them; ``check``, when given, is then called
    with that network (its components' arrays have their final shapes; the random ones
    hold no memory), e.g. to refuse a network by its size; only then are the
    components initialised again, drawing their parameters from ``rng`` (the same
    values as one pass would draw).

    On error ``nnet`` is left unchanged.
    """
    from engine.nnet.components._param_utils import (  # noqa: PLC0415
        budget_left,
        parameter_budget,
        planning,
    )
    if rng is None:
        rng = np.random.default_rng()
    existing = [parse_config_line(t, EXISTING, None) for t in nnet.config_lines()]
    new = [parse_config_line(sl.text, sl.source, sl.line)
           for sl in read_config_lines(text, source)]
    # keep the origin of existing nodes for error messages
    origins = {n.name: n.origin for n in nnet.nodes}
    for cfg in existing:
        org = origins.get(cfg.values.get("name", ""), (EXISTING, None))
        cfg.source, cfg.line = org
    lines = _remove_redundant(existing + new, len(existing))
    component_lines = [cfg for cfg in lines if cfg.first_token == "component"]

    work = Nnet()
    work.components = list(nnet.components)
    work.component_names = list(nnet.component_names)
    initial_components = len(work.components)
    # name -> index tables kept along (a lookup by scan per line made reading an
    # N-line config O(N^2))
    initial_index: dict[str, int] = {}
    for i, name in enumerate(work.component_names):
        initial_index.setdefault(name, i)
    component_index = dict(initial_index)
    # 1. the components without their random values: sizes and options checked, the
    # parameters of the whole config counted before any is drawn
    in_all, left = budget_left()    # (a caller's parameter_budget, or the default)
    planned = 0
    with planning() as counted:
        plan_rng = np.random.default_rng(0)     # (``rng`` is left for the real draw)
        for cfg in component_lines:
            before = counted[0]
            _component_line(work, _fresh_line(cfg), initial_components, plan_rng,
                            component_index)
            n = counted[0] - before
            if planned + n > left:
                name = cfg.values.get("name", "")
                raise cfg.error(f"component {name!r} ({cfg.values.get('type', '')}): its "
                                f"random parameters would hold {n} values; the components "
                                f"of one config may hold {in_all} in all, and "
                                f"{left - planned} are left")
            planned += n
    # 2. the nodes, and the checks of the whole network, with those components
    taken: set[str] = set()
    for cfg in lines:
        _node_line_pass0(work, cfg, taken)
    names = DescriptorNames(work.referable_names(), work.node_names)
    for cfg in lines:
        _node_line_pass1(work, cfg, names, component_index)
    work.validate()
    if check is not None:
        check(work)
    # 3. the components again, drawing their parameters (in the same order, so at the
    # same indexes the nodes refer to)
    work.components = list(nnet.components)
    work.component_names = list(nnet.component_names)
    component_index = dict(initial_index)
    with parameter_budget():
        for cfg in component_lines:
            _component_line(work, cfg, initial_components, rng, component_index)
    nnet.nodes = work.nodes
    nnet.components = work.components
    nnet.component_names = work.component_names


def _component_line(nnet: Nnet, cfg: ConfigLine, initial_components: int, rng,
                    component_index: dict[str, int]) -> None:
    from engine.nnet.components.base import new_component_from_config  # noqa: PLC0415
    name = _require(cfg, "name", "component-name")
    type_name = _require(cfg, "type", "component-type")
    if not _files_allowed.get():
        m = _FILE_OPTION_RE.search(cfg.text)
        if m:
            raise cfg.error(f"option {m.group(1)}=: components that read their parameters "
                            f"from a file are not accepted here (the file would be read on "
                            f"this machine); send the model in Kaldi's text or binary format "
                            f"instead")
    comp = new_component_from_config(type_name, cfg, name, rng)
    idx = component_index.get(name, -1)
    if idx >= 0:
        if idx >= initial_components:
            raise cfg.error(f"two components named {name!r}")
        nnet.components[idx] = comp
    else:
        component_index[name] = len(nnet.components)
        nnet.components.append(comp)
        nnet.component_names.append(name)


def _node_line_pass0(nnet: Nnet, cfg: ConfigLine, taken: set[str]) -> None:
    """Add the node(s) of a node line; ``taken``: the names of the nodes added so far
    (all of ``nnet``'s), to which this line's are added."""
    kind = cfg.first_token
    if kind == "component":
        return
    name = cfg.values["name"]
    origin = (cfg.source, cfg.line)

    def fresh(n: str) -> None:
        if n in taken:
            raise cfg.error(f"node name {n!r} is already used"
                            + (" (by the hidden input node of a component-node)"
                               if n.endswith("_input") else ""))
        taken.add(n)

    if kind == "component-node":
        fresh(name + "_input")
        fresh(name)
        nnet.nodes.append(NetworkNode(name + "_input", NodeType.DESCRIPTOR, origin=origin))
        nnet.nodes.append(NetworkNode(name, NodeType.COMPONENT, origin=origin))
    elif kind == "input-node":
        fresh(name)
        cfg.get_str("name")
        dim = _get_int(cfg, "dim")
        _check_unused(cfg)
        if dim <= 0:
            raise cfg.error(f"invalid dimension dim={dim} (must be > 0)")
        nnet.nodes.append(NetworkNode(name, NodeType.INPUT, dim=dim, origin=origin))
    elif kind == "output-node":
        fresh(name)
        nnet.nodes.append(NetworkNode(name, NodeType.DESCRIPTOR, origin=origin))
    elif kind == "dim-range-node":
        fresh(name)
        nnet.nodes.append(NetworkNode(name, NodeType.DIM_RANGE, origin=origin))
    else:
        raise cfg.error(f"invalid config line: {kind or '(no first token)'!r} not expected "
                        f"(expected input-node, component, component-node, dim-range-node "
                        f"or output-node)")


def _parse_input(cfg: ConfigLine, names: DescriptorNames):
    text = _require(cfg, "input", "input-descriptor")
    try:
        return parse_descriptor(text, names)
    except ConfigError as e:
        raise cfg.error(e.reason) from None


def _node_line_pass1(nnet: Nnet, cfg: ConfigLine, names: DescriptorNames,
                     component_index: dict[str, int]) -> None:
    kind = cfg.first_token
    if kind in ("component", "input-node"):
        return
    name = cfg.get_str("name")
    idx = nnet.get_node_index(name)
    node = nnet.nodes[idx]
    if kind == "component-node":
        cname = _require(cfg, "component", "component-name")
        c = component_index.get(cname, -1)
        if c < 0:
            raise cfg.error(f"no component named {cname!r}")
        node.component_index = c
        nnet.nodes[idx - 1].descriptor = _parse_input(cfg, names)
        _check_unused(cfg)
    elif kind == "output-node":
        node.descriptor = _parse_input(cfg, names)
        obj = cfg.get_str("objective", "linear")
        if obj not in ("linear", "quadratic"):
            raise cfg.error(f"invalid objective type {obj!r} (linear or quadratic)")
        node.objective_type = ObjectiveType(obj)
        _check_unused(cfg)
    elif kind == "dim-range-node":
        src = _require(cfg, "input-node", "input-node-name")
        dim = _get_int(cfg, "dim")
        off = _get_int(cfg, "dim-offset")
        s = nnet.get_node_index(src)
        if s < 0 or nnet.nodes[s].type not in (NodeType.COMPONENT, NodeType.INPUT):
            raise cfg.error(f"invalid input-node {src!r} (must be the name of an input or "
                            f"component node)")
        _check_unused(cfg)
        node.node_index, node.dim, node.dim_offset = s, dim, off


def nnet_from_config_files(paths: list[str], rng=None) -> Nnet:
    """nnet3-init with one or more config files, applied in order."""
    nnet = Nnet()
    for p in paths:
        try:
            with open(p, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read config file: {e.strerror}", source=str(p)) from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config is not UTF-8 text (byte {e.start})",
                              source=str(p)) from None
        apply_config(nnet, text, source=str(p), rng=rng)
    return nnet
