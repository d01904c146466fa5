"""The schedule IR: one ordered list of actions per pipeline rank (docs/architecture.md, principle 3).

Layout of stages (``Schedule.placement``). With ``pp`` ranks and ``vpp`` virtual chunks per rank there
are ``pp * vpp`` global stages; rank ``r`` holds chunks ``c = 0 .. vpp-1``:

    interleaved  chunk ``c`` is global stage ``c * pp + r`` (Megatron's interleaved layout: rank r
                 holds stages r, r+pp, r+2pp, ...); vpp = 1 is the plain pipeline
    v            vpp = 2 in a V (Qi et al.'s ZB-V, DeepSeek's DualPipeV): chunk 0 is stage r, chunk 1
                 stage 2 pp - 1 - r, so rank pp-1 holds the two middle stages and rank 0 the first
                 and the last (embedding and head on one rank)

Stage 0 owns the embedding, the last stage ``pp * vpp - 1`` the LM head and the loss. Two consecutive
stages on one rank (the V's turn) hand over in memory: no communication action joins them, and the
later compute only has to come after the earlier one in the rank's list.

Operations (``Op``):

    F       forward of (microbatch, chunk)
    B       full backward: input and weight gradients together
    BI      backward for the inputs only (zero-bubble split; needs a later BW)
    BW      backward for the weights only (needs the BI of the same microbatch and chunk)
    SEND_F  send F's output activation to the next stage
    RECV_F  receive this chunk's input activation from the previous stage
    SEND_B  send the gradient of this chunk's input to the previous stage
    RECV_B  receive the gradient of this chunk's output from the next stage

A communication action names the *local* chunk: SEND_F/SEND_B carry what chunk ``c`` produced,
RECV_F/RECV_B carry what chunk ``c`` consumes. The peer is the neighbouring global stage (see
``Action.peer``); with vpp > 1 the last rank's chunk c sends forward to rank 0's chunk c+1.

Text form, one line per rank (``Schedule.to_text`` / ``Schedule.from_text``)::

    # mpformer-schedule name=1f1b pp=2 vpp=1 microbatches=2
    r0: F0 sF0 F1 sF1 rB0 B0 rB1 B1
    r1: rF0 F0 B0 sB0 rF1 F1 B1 sB1

A token is ``OP MICROBATCH [. CHUNK] [&]`` with OP one of ``F B BI BW sF rF sB rB`` (s = send,
r = receive); ``F3.1`` is microbatch 3 on chunk 1. A compute marked ``&`` runs beside the rank's next
compute as one pair (DualPipe's overlapped F&B): the pair starts when both its inputs are there,
nothing is posted between its two halves, and the second does not depend on the first. The chunk
is printed only when vpp > 1 and is 0 when omitted. The header is optional: without it pp is the
number of rank lines, vpp and microbatches the largest chunk and microbatch + 1, and the name "custom".

Batching rule (the engine and the verifier share it): a maximal run of adjacent communication
actions on a rank is ONE group. The engine posts the whole group with one batch_isend_irecv and
waits for all of it; a group completes when every peer has posted its matching operation
(blocking, rendezvous semantics). Messages between two ranks also match in posting order, so a
pair of ranks must agree on the order of their messages (verify.py checks both). An engine may
post a group's sends before its receives, but keeps list order among the sends and among the
receives. Generators put each send right after the compute that produces it (except where a later
gap is the first one the receiver shares, see schedules.py) and each receive before its consumer.

Token-level pipelining (TeraPipe, ``slices`` = k > 1): each microbatch is cut into k slices of its
sequence and every slice is a unit of the IR: ``microbatches`` counts units, unit ``u`` is slice
``u % k`` of microbatch ``u // k``. A slice attends to the keys and values the earlier slices of its
microbatch left on the same stage, so on every stage F of slice s comes after F of slice s-1, and
the backward of slice s (B or BI) after that of slice s+1, which adds to slice s's key and value
gradients. The header says ``slices=k``.

CSV form: an optional ``# mpformer-schedule ...`` header line, then ``rank,op,microbatch,chunk``
rows (op spelled as the Op value, e.g. SEND_F) in execution order per rank.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from mpformer.core.errors import ConfigError
from mpformer.core.pipeline_plan import rank_chunk, stage_of


class ScheduleError(ConfigError):
    """A schedule that is malformed, cannot run (deadlock) or mismatches sends and receives.

    It is a ConfigError (hence a ValueError) because a user may write schedules by hand: the CLIs
    print it as one line. The message names the rank, the action (text form) and what is wrong.
    """


class Op(str, Enum):
    F = "F"
    B = "B"
    BI = "BI"
    BW = "BW"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_comm(self) -> bool:
        return self in _COMM

    @property
    def short(self) -> str:
        return _SHORT[self]


_COMM = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
_SHORT = {Op.F: "F", Op.B: "B", Op.BI: "BI", Op.BW: "BW",
          Op.SEND_F: "sF", Op.RECV_F: "rF", Op.SEND_B: "sB", Op.RECV_B: "rB"}
_FROM_SHORT = {v: k for k, v in _SHORT.items()}
# Longest alternatives first so that "BI3" is not read as "B" + "I3".
_TOKEN = re.compile(r"^(BI|BW|sF|rF|sB|rB|F|B)(\d+)(?:\.(\d+))?(&?)$")
_HEADER = "# mpformer-schedule"


PLACEMENTS = ("interleaved", "v")  # which stage a chunk is: core/pipeline_plan.py's stage_of / rank_chunk


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank's list: ``op`` on ``microbatch`` for local ``chunk``."""

    rank: int
    op: Op
    microbatch: int
    chunk: int = 0
    overlap: bool = False  # runs beside the rank's next compute as one pair (DualPipe's F&B)

    def stage(self, pp: int, v: bool = False) -> int:
        """The global stage this action belongs to (``stage_of``)."""
        return stage_of(pp, self.rank, self.chunk, v)

    def token(self, with_chunk: bool = True) -> str:
        """Text form without the rank, e.g. ``sF3.1`` (``F3.0&``: overlapped with the next compute)."""
        suffix = f".{self.chunk}" if with_chunk else ""
        return f"{self.op.short}{self.microbatch}{suffix}{'&' if self.overlap else ''}"

    def describe(self, vpp: int) -> str:
        """``rank 1 action rF3`` — how errors name an action."""
        return f"rank {self.rank} action {self.token(vpp > 1)}"

    def peer_stage(self, pp: int, v: bool = False) -> int:
        """The global stage on the other end of a communication action."""
        s = self.stage(pp, v)
        return s + 1 if self.op in (Op.SEND_F, Op.RECV_B) else s - 1

    def peer(self, pp: int, v: bool = False) -> tuple[int, int]:
        """(rank, chunk) on the other end of a communication action."""
        return rank_chunk(pp, self.peer_stage(pp, v), v)

    def message(self, pp: int, v: bool = False) -> tuple[str, int, int]:
        """The identity of the tensor a communication action moves: (kind, microbatch, source stage).

        A send and a receive match iff their messages are equal; the shape is then the same by
        construction (activations and gradients at a stage boundary are [seq, batch, hidden]).
        """
        op, stage = self.op, self.stage(pp, v)
        if op is Op.SEND_F or op is Op.SEND_B:
            return ("F" if op is Op.SEND_F else "B"), self.microbatch, stage
        return ("F", self.microbatch, stage - 1) if op is Op.RECV_F else ("B", self.microbatch, stage + 1)


def parse_token(token: str, rank: int) -> Action:
    m = _TOKEN.match(token)
    if m is None:
        raise ScheduleError(f"rank {rank}: cannot read action {token!r}; a token is OP MICROBATCH[.CHUNK][&] with "
                            f"OP one of {', '.join(_FROM_SHORT)} (e.g. F3, sF3.1, F3.0& for a compute that "
                            "overlaps the next)")
    op, mb, chunk, pair = m.groups()
    return Action(rank, _FROM_SHORT[op], int(mb), int(chunk or 0), pair == "&")


@dataclass(frozen=True)
class Schedule:
    """pp, vpp, microbatches, a name, and ``actions[r]``: rank r's actions in execution order."""

    pp: int
    vpp: int
    microbatches: int
    name: str
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    placement: str = "interleaved"  # which chunk is which stage (module docstring)
    slices: int = 1  # token-level pipelining: each microbatch is ``slices`` units (module docstring)

    def __post_init__(self) -> None:
        if len(self.actions) != self.pp:
            raise ScheduleError(f"schedule {self.name!r} has {len(self.actions)} rank lists for pp={self.pp}")
        if self.placement not in PLACEMENTS:
            raise ScheduleError(f"placement {self.placement!r} is unknown; valid: {', '.join(PLACEMENTS)}")
        if self.placement == "v" and (self.vpp != 2 or self.pp < 2):
            raise ScheduleError(f"placement v needs vpp=2 and pp >= 2, got vpp={self.vpp} pp={self.pp}")
        if self.slices < 1 or self.microbatches % self.slices:
            raise ScheduleError(f"slices={self.slices} must be >= 1 and divide the {self.microbatches} units "
                                f"(microbatches x slices); valid: {', '.join(map(str, _divisors(self.microbatches)))}")

    @property
    def v(self) -> bool:
        """The V placement (module docstring)."""
        return self.placement == "v"

    def stage(self, rank: int, chunk: int) -> int:
        return stage_of(self.pp, rank, chunk, self.v)

    def local(self, stage: int, other: int) -> bool:
        """Whether two stages sit on one rank (the V's turn): they hand over without a message."""
        return rank_chunk(self.pp, stage, self.v)[0] == rank_chunk(self.pp, other, self.v)[0]

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def __len__(self) -> int:
        return sum(len(a) for a in self.actions)

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if not a.op.is_comm]

    # -- text ---------------------------------------------------------------------------------
    def header(self) -> str:
        place = " placement=v" if self.v else ""
        sliced = f" slices={self.slices}" if self.slices > 1 else ""
        return f"{_HEADER} name={self.name} pp={self.pp} vpp={self.vpp} microbatches={self.microbatches}{place}{sliced}"

    def to_text(self) -> str:
        chunked = self.vpp > 1
        lines = [self.header()]
        lines += [f"r{r}: " + " ".join(a.token(chunked) for a in acts) for r, acts in enumerate(self.actions)]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        meta: dict[str, str] = {}
        rows: dict[int, list[Action]] = {}
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if line.startswith(_HEADER):
                meta = _read_header(line)
                continue
            if not line or line.startswith("#"):
                continue
            head, sep, body = line.partition(":")
            if not sep or not re.fullmatch(r"r\d+", head.strip()):
                raise ScheduleError(f"line {lineno}: expected 'r<rank>: TOKEN ...', got {raw.strip()!r}")
            rank = int(head.strip()[1:])
            if rank in rows:
                raise ScheduleError(f"line {lineno}: rank {rank} is listed twice")
            rows[rank] = [parse_token(t, rank) for t in body.split()]
        return _assemble(rows, meta)

    # -- csv ----------------------------------------------------------------------------------
    def to_csv(self) -> str:
        buf = io.StringIO()
        buf.write(self.header() + "\n")
        w = csv.writer(buf, lineterminator="\n")
        pairs = any(a.overlap for acts in self.actions for a in acts)  # the column only where it says something
        w.writerow(["rank", "op", "microbatch", "chunk"] + (["overlap"] if pairs else []))
        for acts in self.actions:
            w.writerows([a.rank, a.op.value, a.microbatch, a.chunk] + ([int(a.overlap)] if pairs else [])
                        for a in acts)
        return buf.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> Schedule:
        meta: dict[str, str] = {}
        body = []
        for line in text.splitlines():
            if line.startswith(_HEADER):
                meta = _read_header(line)
            elif line.strip() and not line.startswith("#"):
                body.append(line)
        reader = csv.DictReader(body)
        columns = ["rank", "op", "microbatch", "chunk"]
        if reader.fieldnames not in (columns, [*columns, "overlap"]):
            raise ScheduleError(f"CSV header must be rank,op,microbatch,chunk[,overlap], got {reader.fieldnames}")
        rows: dict[int, list[Action]] = {}
        for i, row in enumerate(reader, 2):
            try:
                a = Action(int(row["rank"]), Op(row["op"]), int(row["microbatch"]), int(row["chunk"]),
                           row.get("overlap", "0") == "1")
            except (ValueError, TypeError):
                raise ScheduleError(f"CSV row {i}: cannot read {row}; op is one of "
                                    f"{', '.join(o.value for o in Op)}") from None
            rows.setdefault(a.rank, []).append(a)
        return _assemble(rows, meta)


def _read_header(line: str) -> dict[str, str]:
    pairs = line[len(_HEADER):].split()
    try:
        return dict(p.split("=", 1) for p in pairs)  # type: ignore[misc]
    except ValueError:
        raise ScheduleError(f"cannot read header {line!r}; expected key=value pairs "
                            "(name, pp, vpp, microbatches, placement)") from None


def _assemble(rows: dict[int, list[Action]], meta: dict[str, str]) -> Schedule:
    try:
        pp = int(meta.get("pp", max(rows, default=-1) + 1))
        acts = [a for lst in rows.values() for a in lst]
        vpp = int(meta.get("vpp", max((a.chunk for a in acts), default=0) + 1))
        mbs = int(meta.get("microbatches", max((a.microbatch for a in acts), default=-1) + 1))
        slices = int(meta.get("slices", 1))
    except ValueError:
        raise ScheduleError(f"header values must be integers: {meta}") from None
    if pp < 1 or vpp < 1 or mbs < 1:
        raise ScheduleError(f"need pp, vpp, microbatches >= 1, got pp={pp} vpp={vpp} microbatches={mbs}")
    missing = [r for r in range(pp) if r not in rows]
    extra = sorted(r for r in rows if r >= pp)
    if missing or extra:
        raise ScheduleError(f"a schedule for pp={pp} lists ranks 0..{pp - 1}; missing {missing}, extra {extra}")
    return Schedule(pp, vpp, mbs, meta.get("name", "custom"), tuple(tuple(rows[r]) for r in range(pp)),
                    meta.get("placement", "interleaved"), slices)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def load_schedule(path: str | Path) -> Schedule:
    """Read a hand-written schedule: CSV if the file ends in .csv, the text form otherwise."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ScheduleError(f"cannot read schedule file {str(path)!r}: {e.strerror}") from None
    return Schedule.from_csv(text) if path.suffix.lower() == ".csv" else Schedule.from_text(text)


def make_schedule(name: str, pp: int, vpp: int, microbatches: int,
                  lists: Sequence[Iterable[Action]], placement: str = "interleaved", slices: int = 1) -> Schedule:
    """Freeze per-rank lists into a Schedule (generators build plain lists, then call this)."""
    return Schedule(pp, vpp, microbatches, name, tuple(tuple(x) for x in lists), placement, slices)


def repeat(schedule: Schedule, times: int) -> Schedule:
    """The schedule run ``times`` steps back to back with no barrier between steps.

    Step k uses microbatches k*m .. k*m+m-1. The simulator uses it for the steady-state bubble: a
    zero-bubble schedule only reaches ~0 idle when a step's tail overlaps the next step's head
    (Qi et al. remove the optimizer-step barrier for that); one isolated step always keeps the
    pipeline fill and drain.
    """
    m = schedule.microbatches
    # Ranks iterate k outermost: a rank finishes its list for step k before starting step k+1.
    lists = [[Action(a.rank, a.op, a.microbatch + k * m, a.chunk, a.overlap) for k in range(times) for a in acts]
             for acts in schedule.actions]
    return make_schedule(f"{schedule.name}x{times}", schedule.pp, schedule.vpp, m * times, lists, schedule.placement,
                         schedule.slices)
