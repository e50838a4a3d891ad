"""A model of the mbarrier protocol of a generated warp-specialized kernel, run on the CPU.

cuda_emu cannot run warp-specialized kernels (no TMA, wgmma or mbarriers on CPU threads), so this checks what
a wrong pipeline does on the GPU: hang, or read a stage before its TMA load landed, or let the producer overwrite
a stage the tensor cores still read. It reads the generated CUDA source itself (not the codegen's plan): the
producer thread's loop and the consumer warps' code, keeping only the statements of the protocol

    mbarrier_wait / mbarrier_arrive / mbarrier_arrive_expect_tx / tma_load_2d (producer),
    make_smem_desc of a staged buffer (a wgmma operand read: from the issue to the wgmma_wait retiring its group),
    wgmma_commit / wgmma_wait<n>, named_barrier_sync / named_barrier_arrive,

with the loops and ifs around them and the `const int` lets they use (C integer expressions evaluated in
Python), and runs one producer actor and one actor per consumer warp under a seeded random scheduler, TMA loads
landing at random later times (`p_land`: the chance per step; a low one lands them as late as possible, which is
what exposes a read without a wait). mbarriers follow the PTX semantics: `count` arrivals plus the expected
transactions complete a phase; `try_wait.parity(p)` passes while the number of completed phases has the other
parity than p. Named barriers count 32 threads per warp.

A persistent kernel runs as one CTA of the grid (its tile loop `_tile += gridDim.x`, the stage counter `_kb`
running on across tiles). Not modelled (a ProtocolError says so): TMA multicast / clusters.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field


class ProtocolError(AssertionError):
    pass


# ---------------------------------------------------------------- parsing: lines -> a tree of blocks

@dataclass
class Node:
    head: str  # the line opening the block ("" for the root), or the statement itself for a leaf
    body: list = field(default_factory=list)
    orelse: list | None = None


_OPS = re.compile(r"mbarrier_wait\(|mbarrier_arrive\(|mbarrier_arrive_expect_tx\(|tma_load_2d\(|make_smem_desc\(|"
                  r"wgmma_commit\(|wgmma_wait<|named_barrier_sync\(|named_barrier_arrive\(|tl_mbar_arrive_peer|"
                  r"cluster_sync\(|__syncthreads\(")


def parse(lines: list[str]) -> Node:
    root = Node("")
    stack = [root]
    for raw in lines:
        ln = raw.split("//")[0].strip()  # generated code has no "//" outside comments
        if not ln or ln.startswith("#"):
            continue
        if ln.startswith("}"):
            node = stack.pop()
            if ln.startswith("} else {"):
                node.orelse = []
                stack.append(_Else(node))
            continue
        if ln.endswith("{"):
            node = Node(ln)
            _body(stack[-1]).append(node)
            stack.append(node)
        else:
            _body(stack[-1]).append(Node(ln))
    return root


class _Else:
    """The else branch of `node`, as a stack entry."""

    def __init__(self, node: Node) -> None:
        self.node = node


def _body(entry) -> list:
    return entry.node.orelse if isinstance(entry, _Else) else entry.body


def has_ops(node: Node) -> bool:
    if _OPS.search(node.head):
        return True
    return any(has_ops(c) for c in node.body) or any(has_ops(c) for c in node.orelse or [])


def _split_if(ln: str) -> tuple[str, str]:
    """`if (cond) rest` -> (cond, rest), parentheses matched."""
    assert ln.startswith("if (")
    depth = 0
    for i, ch in enumerate(ln[3:], 3):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return ln[4:i], ln[i + 1:].strip()
    raise ProtocolError(f"unbalanced if: {ln}")


def c_eval(expr: str, env: dict) -> int:
    e = re.sub(r"(\w+)<\w+>\(", r"\1(", expr)  # tl_min<int>(a, b) -> tl_min(a, b)
    e = e.replace("&&", " and ").replace("||", " or ").replace("(int)", "").replace("/", "//")
    e = re.sub(r"!(?!=)", " not ", e).replace("true", "True").replace("false", "False")
    try:
        return eval(e, {"__builtins__": {}, "min": min, "max": max, "tl_min": min, "tl_max": max,
                          "tl_floordiv": lambda a, b: a // b, "tl_floormod": lambda a, b: a % b}, env)  # noqa: S307
    except Exception as ex:  # noqa: BLE001 - a name the model does not know
        raise NameError(f"cannot evaluate {expr!r}: {ex}") from ex


# ---------------------------------------------------------------- the machine

class Mbar:
    def __init__(self, count: int) -> None:
        self.count, self.arrived, self.tx, self.phases = count, 0, 0, 0

    def _maybe_complete(self) -> None:
        if self.arrived >= self.count and self.tx == 0:
            self.arrived, self.phases = self.arrived - self.count, self.phases + 1

    def arrive(self, tx: int = 0) -> None:
        self.arrived += 1
        self.tx += tx
        self._maybe_complete()

    def land(self) -> None:
        self.tx -= 1
        self._maybe_complete()

    def passed(self, parity: int) -> bool:
        return (self.phases & 1) != (parity & 1)


class NamedBar:
    def __init__(self) -> None:
        self.threads, self.generation = 0, 0

    def arrive(self, count: int) -> int:
        self.threads += 32
        gen = self.generation
        if self.threads >= count:
            self.threads, self.generation = 0, self.generation + 1
        return gen


@dataclass
class Machine:
    bars: dict  # name -> [Mbar per stage]
    loads_per_bar: dict  # name -> TMA loads the producer issues per arm of that barrier
    start: int  # the pipelined loop's start (iteration = k - start)
    content: dict = field(default_factory=dict)  # (buffer, stage) -> iteration landed there
    writing: dict = field(default_factory=dict)  # (buffer, stage) -> iteration of the TMA load in flight
    inflight: list = field(default_factory=list)  # [(buffer, stage, iteration, barrier)]
    reads: dict = field(default_factory=dict)  # warp -> [[(buffer, stage)] per committed group]
    pending_reads: dict = field(default_factory=dict)  # warp -> [(buffer, stage)] not committed yet
    named: dict = field(default_factory=dict)
    trace: list = field(default_factory=list)

    def active_reads(self, key) -> list:
        out = [w for w, gs in self.reads.items() if any(key in g for g in gs)]
        return out + [w for w, rs in self.pending_reads.items() if key in rs]


def _bar(m: Machine, ref: str, env: dict) -> Mbar:
    mt = re.match(r"&(\w+)\[(.+)\]$", ref.strip())
    if not mt or mt.group(1) not in m.bars:
        raise ProtocolError(f"unknown mbarrier {ref!r}")
    return m.bars[mt.group(1)][c_eval(mt.group(2), env)]


def _args(call: str) -> list[str]:
    """The top-level comma-separated arguments of `name(...)`."""
    inner = call[call.index("(") + 1:call.rindex(")")]
    out, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch in "(["
        depth -= ch in ")]"
        cur += ch
    out.append(cur.strip())
    return out


def run_actor(m: Machine, nodes: list, env: dict, who, producer: bool):
    """A generator over the protocol statements of `nodes` (yields between them; `("block", why)` while it waits)."""
    for node in nodes:
        head = node.head
        if node.body or node.orelse is not None or head.endswith("{"):
            if not has_ops(node):
                continue
            if head.startswith("for ("):
                mt = re.match(r"for \(int (\w+) = (.+?); \1 < (.+?); (?:\+\+\1|\1 \+= (.+?))\) \{$", head)
                if not mt:
                    raise ProtocolError(f"loop not modelled: {head}")
                v, a, b, step = mt.groups()
                i = c_eval(a, env)
                while i < c_eval(b, env):
                    env[v] = i
                    yield from run_actor(m, node.body, env, who, producer)
                    i += c_eval(step, env) if step else 1
            elif head.startswith("if ("):
                cond, _ = _split_if(head)
                if c_eval(cond, env):
                    yield from run_actor(m, node.body, env, who, producer)
                elif node.orelse is not None:
                    yield from run_actor(m, node.orelse, env, who, producer)
            elif head == "{":
                yield from run_actor(m, node.body, env, who, producer)
            else:
                raise ProtocolError(f"block not modelled: {head}")
            continue
        yield from _leaf(m, head, env, who, producer)


def _leaf(m: Machine, ln: str, env: dict, who, producer: bool):
    if ln.startswith("if ("):
        cond, rest = _split_if(ln)
        if _OPS.search(rest) or rest.startswith("const int"):
            if c_eval(cond, env):
                yield from _leaf(m, rest, env, who, producer)
        return
    mt = re.match(r"(\w+) \+= (.+);$", ln) or re.match(r"int (\w+) = (.+);$", ln)
    if mt:  # a persistent kernel's counter of the pipeline iterations of the tiles before (`int _kb = 0;`, `+=`)
        name, e = mt.groups()
        env[name] = (env[name] if ln.startswith(name + " +=") else 0) + c_eval(e, env)
        return
    mt = re.match(r"const int (\w+) = (.+);$", ln)
    if mt:
        name, e = mt.groups()
        if not re.search(r", \w+ = ", e):  # one declaration (not `const int a = .., b = ..;`)
            try:
                env[name] = c_eval(e, env)
            except NameError:  # a value the model has no use for (thread indices of a copy, blockIdx)
                pass
        return
    for stmt in [s.strip() for s in ln.split(";") if s.strip()]:
        if stmt.startswith("if ("):
            yield from _leaf(m, stmt + ";", env, who, producer)
        else:
            yield from _op(m, stmt, env, who, producer)


def _op(m: Machine, st: str, env: dict, who, producer: bool):
    st = st.removeprefix("tilehal::")
    if st.startswith(("tl_mbar_arrive_peer", "cluster_sync")):
        raise ProtocolError("TMA multicast / clusters are not modelled")
    if st.startswith("mbarrier_wait("):
        ref, par = _args(st)
        bar, p = _bar(m, ref, env), c_eval(par, env)
        while not bar.passed(p):
            yield ("block", f"{who} waits on {ref} parity {p}")
        m.trace.append((who, "wait", ref, env.get("k")))
        yield ("step", None)
    elif st.startswith("mbarrier_arrive_expect_tx("):
        ref, _ = _args(st)
        name = re.match(r"&(\w+)\[", ref.strip()).group(1)
        _bar(m, ref, env).arrive(tx=m.loads_per_bar[name])  # the loads armed for: landing one is one transaction
        yield ("step", None)
    elif st.startswith("mbarrier_arrive("):
        (ref,) = _args(st)
        _bar(m, ref, env).arrive()
        m.trace.append((who, "arrive", ref, env.get("k")))
        yield ("step", None)
    elif st.startswith("tma_load_2d("):
        a = _args(st)
        mt = re.match(r"&(\w+)\[\(_s \* \d+\)", a[0])
        if not mt:
            raise ProtocolError(f"TMA destination not modelled: {a[0]}")
        key = (mt.group(1), env["_s"])
        it = env.get("_kb", 0) + env["k"] - m.start  # the pipeline iteration (persistent: over the tiles)
        if m.active_reads(key):
            raise ProtocolError(f"the producer overwrites {key} (iteration {it}) while warps {m.active_reads(key)} "
                                f"still read it")
        m.writing[key] = it
        m.inflight.append((key, it, _bar(m, a[2], env)))
        yield ("step", None)
    elif st.startswith(("const tilehal::u64 _d", "u64 _d")) or "make_smem_desc(" in st:
        mt = re.search(r"make_smem_desc\(&(\w+)\[\(\((\w+)\) \* \d+", st)
        if mt is None:
            return  # an operand that is not staged (Q)
        buf, var = mt.groups()
        key = (buf, env[var])
        want = env.get("_kb", 0) + env["k"] - m.start - (1 if var.startswith("_prev") else 0)
        if m.content.get(key) != want or key in m.writing:
            raise ProtocolError(f"warp {who} reads {key} for iteration {want} but it holds "
                                f"{m.content.get(key)} (a load in flight: {m.writing.get(key)})")
        m.pending_reads.setdefault(who, []).append(key)
        yield ("step", None)
    elif st.startswith("wgmma_commit("):
        m.reads.setdefault(who, []).append(m.pending_reads.pop(who, []))
    elif st.startswith("wgmma_wait<"):
        n = int(re.match(r"wgmma_wait<(\d+)>", st).group(1))
        gs = m.reads.setdefault(who, [])
        m.reads[who] = gs[len(gs) - n:] if n else []
        yield ("step", None)
    elif st.startswith(("named_barrier_sync(", "named_barrier_arrive(")):
        bid, cnt = (c_eval(x, env) for x in _args(st))
        nb = m.named.setdefault(bid, NamedBar())
        gen = nb.arrive(cnt)
        if st.startswith("named_barrier_sync("):
            while nb.generation == gen:
                yield ("block", f"{who} at named barrier {bid}")
        yield ("step", None)
    elif st.startswith("__syncthreads("):
        raise ProtocolError("a block-wide barrier in the consumers' code")


# ---------------------------------------------------------------- the kernel's two roles

def _kernel_lines(src: str) -> list[str]:
    lines = src.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith('extern "C" __global__'))
    return lines[i + 1:]


def roles(src: str) -> tuple[dict, dict, list, list, int, int]:
    """(barriers name -> (stages, count), loads per barrier arm, producer nodes, consumer nodes, consumer warps,
    loop start)."""
    lines = _kernel_lines(src)
    init = next(ln for ln in lines if "mbarrier_init(&" in ln)
    stages = int(re.search(r"_s < (\d+)", init).group(1))
    bars = {n: (stages, int(c)) for n, c in re.findall(r"mbarrier_init\(&(\w+)\[_s\], (\d+)\)", init)}
    p0 = next(i for i, ln in enumerate(lines) if re.match(r"\s*if \(_tx >= (\d+)\) \{$", ln))
    threads = int(re.match(r"\s*if \(_tx >= (\d+)\)", lines[p0]).group(1))
    depth, p1 = 0, p0
    for p1 in range(p0, len(lines)):
        depth += lines[p1].count("{") - lines[p1].count("}")
        if depth == 0:
            break
    pre = [ln for ln in lines[:p0] if re.match(r"\s*const int \w+ = ", ln)]  # block indices (and lets)
    producer = parse(pre + lines[p0 + 1:p1]).body
    consumer = parse(pre + lines[p1 + 1:-1]).body
    loads: dict = {}
    for ln in lines[p0:p1]:
        for b in re.findall(r"tma_load_2d\(&\w+\[[^;]*?, &\w+, &(\w+)\[_s\]", ln):
            loads[b] = loads.get(b, 0) + 1
    mt = re.search(r"const int _s = \((?:_kb \+ )?k - \((.+?)\)\) % \d+;", src)
    start = int(mt.group(1)) if mt and mt.group(1).isdigit() else 0
    return bars, loads, producer, consumer, threads // 32, start


class Dim3:
    def __init__(self, x: int = 0, y: int = 0, z: int = 0) -> None:
        self.x, self.y, self.z = x, y, z


def check(src: str, env: dict, seeds=range(6), p_lands=(0.02, 0.3, 1.0), max_steps: int = 2_000_000) -> Machine:
    """Run the protocol of `src` under len(seeds) x len(p_lands) schedules; `env`: values of the kernel's block
    indices (bx, by, bz), or for a persistent kernel `blockIdx` / `gridDim` (Dim3: the CTA runs tiles blockIdx.x,
    blockIdx.x + gridDim.x, ...), and any other free names. Returns the machine of the last run (its `trace`: every wait
    passed and every arrival, with the warp and k); raises ProtocolError on a deadlock, an early read, an
    overwrite, or a wgmma group left unwaited."""
    bars, loads, prod, cons, warps, start = roles(src)
    ptx = sorted({int(t) for t in re.findall(r"if \(_tx == (\d+)\) \{", src) if int(t) >= warps * 32}) or [warps * 32]
    for seed in seeds:
        for p_land in p_lands:
            rng = random.Random(seed * 1000 + int(p_land * 100))
            m = Machine({n: [Mbar(c) for _ in range(s)] for n, (s, c) in bars.items()}, loads, start)
            # one producer actor per producer thread (cuda_ws_split_producers: a thread per group of copies)
            actors = {("producer" if i == 0 else f"producer{i}"): run_actor(m, prod, {**env, "_tx": t}, "producer", True)
                      for i, t in enumerate(ptx)}
            for w in range(warps):
                actors[w] = run_actor(m, cons, {**env, "_tx": w * 32}, w, False)
            blocked: dict = {}
            steps = 0
            while actors or m.inflight:
                steps += 1
                if steps > max_steps:
                    raise ProtocolError("no end after max_steps")
                runnable = list(actors)
                if m.inflight and (not runnable or rng.random() < p_land or len(blocked) == len(actors)):
                    key, it, bar = m.inflight.pop(rng.randrange(len(m.inflight)))
                    m.content[key] = it
                    if m.writing.get(key) == it:
                        del m.writing[key]
                    bar.land()
                    blocked.clear()
                    continue
                if not runnable:
                    break
                if len(blocked) == len(actors) and not m.inflight:
                    raise ProtocolError("deadlock: " + "; ".join(str(v) for v in blocked.values()))
                who = rng.choice(runnable)
                try:
                    kind, why = next(actors[who])
                except StopIteration:
                    del actors[who]
                    blocked.pop(who, None)
                    continue
                if kind == "block":
                    blocked[who] = why
                else:
                    blocked.clear()
            left = {w: gs for w, gs in m.reads.items() if any(gs)}
            if left:
                raise ProtocolError(f"wgmma groups never waited for: {left}")
    return m
