"""One ranking: every finding's ``cost_s`` in the same currency, each second counted once.

Every detector prices its cause as *the wall-clock the job would save if that
cause were removed*. Detectors run independently, so two of them can price
the same seconds: rank 3 arrives late at the all-reduce (``straggler``)
*because* it waited on its data loader (``input_bound``), or rank 0 is late at
the bcast because it runs an evaluation the others do not (``serial_section``).
Fixing the cause removes both findings' seconds at once; listing both at full
price would promise a saving twice.

The rule, applied by :func:`rank_findings` (the pipeline's last stage):

0. **By replay, where the replay priced it** (issue 20, :func:`_price_by_replay`):
   the findings whose counterfactual the replay priced (``evidence.replay.saving_s``)
   are removed one after another in causal order (each kind's ``Role.removal``, :mod:`distdiag.roles`:
   the subsystem that held a rank, then the subsystem finding it explains,
   then the code path, then the symptom, then what is left of the waiting: a
   load imbalance that moves between ranks), and each costs what it adds to
   those before it. Each second is then counted once by construction, and
   rule 1 below applies only to a pair of which one was not replayed (a
   change the replay cannot see, a Slurm finding, a hang). A finding whose own replayed
   saving is under its threshold is dropped: the detector's price was the noise the replay
   does not reproduce (a healthy run's jitter at point-to-point arrivals, a start-up whose
   counterfactual moves by a few tens of ms). One exception: a ``straggler`` named at
   collectives only stays (a straggler at the ``Reduce`` calls of a run that only reduces
   saves nothing by replay, the non-roots never wait).

1. **Symptoms vs causes.** Findings come in three tiers:

   * *mechanisms* (``Role.tier`` 0): ``input_bound``, ``h2d_copy``,
     ``metadata_storm``, ``io_bandwidth``, ``slow_link``: a subsystem that
     held a rank; each claims the rank-time of its own recorded calls
     (``Role.claims``: loader waits, copies, file calls, point-to-point) on
     the ranks it names, or what its detector states (``Finding.claims``:
     ``io_bandwidth``'s large transfers, ``io_bound``'s bursts);
   * *code paths*: ``serial_section`` claims its charged windows (the
     ``[second-to-last arrival, last arrival]`` of each serial collective, on
     the late rank; see :mod:`distdiag.detectors.serial_section`);
   * *symptoms*: ``straggler``: a rank arrived last; its charge at a
     collective is the window ``[second-to-last arrival, last arrival]``;
     ``startup``: its binding rank's start-up, charged with the part of its
     price its slow module files make (``module_file_excess_s``): a
     ``metadata_storm`` among those files (an import storm) explains that part,
     never the setup (dataset, model, init) the price also holds.

   A finding of a lower tier loses the seconds of its windows that a
   higher-tier finding's claims cover on the same rank: what the rank did
   during its lateness is the cause, the lateness the symptom. The cause keeps
   its full cost (it is the thing to fix), the symptom keeps the rest, and is
   dropped when the rest falls under its threshold (``min_fraction`` of the
   wall-clock, its own or [analyze]'s).

   What a cause takes away is capped by the cause's own cost (a loader wait
   the compute hid on another rank, which ``input_bound`` priced at 0, explains
   nothing), and what all causes take away is capped by the symptom's cost.

   Worked example: rank 0 arrives last at 5 bcasts, 0.30 s each after a 0.30 s
   evaluation, and last by chance at 5 all-reduces, 8 ms each: straggler 1.54
   s, serial_section 1.50 s. The serial windows cover the 5 bcast windows
   exactly: straggler keeps 1.54 - 1.50 = 0.04 s, 1.3% of a 3 s run, under
   2%: dropped. The report lists serial_section at 1.50 s, once.

2. **Shares.** ``fraction`` = cost over the wall-clock (a finding about the
   queue, ``evidence["fraction_of"] == "turnaround"``, over the turnaround).

3. **Order.** By ``cost_s``, largest first: the first is the verdict. A
   finding that ended the job (``evidence["ends_job"]``: a hang) is charged
   the whole run it lost (:func:`_charge_lost_runs`), so it comes first. Since
   every second is counted once, fixing the first leaves a run of ``wall -
   cost_1`` in which the second binds with ``cost_2 / (wall - cost_1)`` of the
   time: :func:`outlook` says that for the report.

A host-level straggler (a slow node) is charged from the last arrival on any
other host, and its windows are the stretches of its last-arriving ranks.

Not de-duplicated (documented limits): two mechanisms on the same seconds
(a metadata storm and a large read in one window), and findings about
the hardware's efficiency (``gpu_underutilized``) or outside the ranks' run
(``queue_wait``, ``launch_overhead``), which share no seconds with the rest.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from distdiag.claims import claims_of
from distdiag.findings import Finding, Windows
from distdiag.roles import role_of
from distdiag.intervals import covered_within, union_banded
from distdiag.match import Collectives
from distdiag.startup_floor import floor_of

if TYPE_CHECKING:
    from distdiag.config import Config
    from distdiag.run import Run

log = logging.getLogger(__name__)

def rank_findings(findings: list[Finding], run: Run, colls: Collectives, cfg: Config, model: Any = None) -> list[Finding]:
    """De-duplicate (see the module docstring), set ``fraction``, sort by cost; returns the reported list.
    ``model``: the replay model (:func:`distdiag.replay.price`) that priced the findings, or None."""
    wall_s = float(run.wall_s)
    saved = [(f, f.cost_s, dict(f.evidence)) for f in findings]
    try:
        findings = _price_by_replay(findings, model, cfg, wall_s)
    except Exception as e:  # never costs the report: the detectors' prices, as they were
        log.debug("replay", exc_info=True)
        run.warnings.append(f"the replay could not price the causes together ({type(e).__name__}: {e})")
        for f, cost, ev in saved:  # a handful
            f.cost_s, f.evidence = cost, ev
            if isinstance(ev.get("replay"), dict):
                ev["replay"] = {k: v for k, v in ev["replay"].items() if k not in ("together_s", "after_above_s")}
        findings = [f for f, _c, _e in saved]
    findings = _link_explains_network(findings, cfg, wall_s)
    findings = _mechanism_explains_subsystem(findings, cfg, wall_s)
    kept = _deduplicate(findings, run, colls, cfg, wall_s)
    _charge_lost_runs(kept, run, wall_s)
    for f in kept:
        base = wall_s
        if f.evidence.get("fraction_of") == "turnaround" and f.evidence.get("turnaround_s"):
            base = float(f.evidence["turnaround_s"])
        f.fraction = float(f.cost_s) / base if base > 0 else 0.0
    # By cost (the JSON contract); a finding that ended the job wins a tie.
    kept.sort(key=lambda f: (-float(f.cost_s), not f.evidence.get("ends_job", False)))
    if len(kept) >= 2:
        # the JSON carries it too: what binds once the verdict is fixed
        nxt = outlook(kept, wall_s, limit=2)[1]
        kept[0].evidence["next_once_fixed"] = {"kind": nxt["kind"], "cost_s": round(nxt["cost_s"], 6),
                                               "wall_s": round(nxt["wall_s"], 6), "share": round(nxt["share"], 4)}  # fmt: skip
    return kept


def replayed(f: Finding) -> bool:
    """True when the replay priced ``f`` (its ``cost_s`` is then the replay's, :func:`_price_by_replay`)."""
    rp = f.evidence.get("replay")
    return f.change is not None and isinstance(rp, dict) and rp.get("saving_s") is not None


def _label(f: Finding) -> str:
    return f"{f.kind} ranks {','.join(map(str, f.ranks))}" if f.ranks else f.kind


def _threshold(f: Finding, cfg: Config) -> float:
    """The share of the run under which a finding that causes above it explained is dropped."""
    if role_of(f.kind).subsystem:
        return float(cfg.value(f.kind, "min_share", 0.1))
    return float(cfg.value(f.kind, "min_fraction", getattr(cfg, "min_fraction", 0.02)))


def _price_by_replay(findings: list[Finding], model: Any, cfg: Config, wall_s: float) -> list[Finding]:
    """Each finding the replay priced costs what the replay saves once the causes before it in
    their ``Role.removal`` order are removed (:func:`distdiag.replay.cumulate`): each second counted once by
    construction, and never more than the finding's own saving (the synergy of two causes,
    each hiding the other, stays in ``together_s``). The detector's own price stays in
    ``evidence.detector_cost_s``. A finding that the causes before it explain in part says by
    whom (``evidence.deduplicated``; each such cause ``evidence.includes``: the seconds both
    save, each alone less both at once), and is dropped when what it keeps falls under its
    threshold. Worked example: rank 3 waits 5 ms on its loader
    and computes 10 ms longer at each of 50 all-reduces; input_bound (removed first) 0.25 s,
    the straggler at its peers' pace alone 0.735 s, after the loader waits 0.49 s."""
    mine = [f for f in findings if replayed(f)]
    if model is None or not mine:
        return findings
    from distdiag.replay import cumulate, overlap_s

    mine.sort(key=lambda f: (role_of(f.kind).removal, -float(f.evidence["replay"]["saving_s"])))
    above: list[Finding] = []

    def keep(f: Finding, added: float) -> bool:
        own = float(f.evidence["replay"]["saving_s"])
        f.evidence["detector_cost_s"] = float(f.cost_s)
        collective_straggler = f.kind == "straggler" and not float(f.evidence.get("p2p_wait_s") or 0.0) > 0
        if own < _threshold(f, cfg) * wall_s and not collective_straggler:
            # removed, it saves less than its threshold: what the detector priced was noise the
            # replay does not reproduce (point-to-point arrivals by chance, a healthy start-up)
            log.info("%s ranks %s: the replay saves %.3f s without it; dropped", f.kind, f.ranks, own)
            return False
        # what it adds to the causes before it, never more than what fixing it alone saves: two
        # stragglers that each hide the other's lateness save more together than apart, and that
        # synergy is in ``together_s``, not promised by either alone
        added = min(added, own)
        f.cost_s = added
        explained = own - added
        if explained <= 0.01 * own + 1e-6 or not above:
            above.append(f)
            return True
        taken = {}
        for c in above:  # a handful: one replay each, only for a finding explained in part
            v = min(overlap_s(model, c, f), explained)
            if v > 1e-6:
                taken[_label(c)] = round(v, 4)
                c.evidence.setdefault("includes", {})[_label(f)] = round(v, 4)
        f.evidence["deduplicated"] = {"cost_before_s": round(own, 4), "explained_by": taken}
        if added < _threshold(f, cfg) * wall_s:
            log.info("%s ranks %s: %.3f s of %.3f s explained by %s; dropped", f.kind, f.ranks, explained, own, taken)
            return False
        above.append(f)
        return True

    kept = {id(f) for f in cumulate(mine, model, keep)}
    return [f for f in findings if not replayed(f) or id(f) in kept]


def _link_explains_network(findings: list[Finding], cfg: Config, wall_s: float) -> list[Finding]:
    """A slow link found explains part of why the network binds: ``network_bound`` (the
    waits on the network, whatever their cause) keeps what the links' costs leave, and is
    dropped when that is under its ``min_share`` of the run."""
    all_links = [f for f in findings if f.kind == "slow_link"]
    if not all_links:
        return findings
    share = float(cfg.value("network_bound", "min_share", 0.1))
    out = []
    for f in findings:
        # both replayed: the replay counted their seconds once already (_price_by_replay)
        links = [c for c in all_links if not (replayed(c) and replayed(f))]
        taken = sum(float(c.cost_s) for c in links)
        if f.kind == "network_bound" and links:
            before = float(f.cost_s)
            f.cost_s = max(0.0, before - taken)
            f.evidence["deduplicated"] = {"cost_before_s": round(before, 4),
                                          "explained_by": {"slow_link": round(min(before, taken), 4)}}  # fmt: skip
            for c in links:
                c.evidence.setdefault("includes", {})["network_bound"] = round(min(before, float(c.cost_s)), 4)
            if f.cost_s < share * wall_s:
                continue
        out.append(f)
    return out


def _mechanism_explains_subsystem(findings: list[Finding], cfg: Config, wall_s: float) -> list[Finding]:
    """As :func:`_link_explains_network`, for the other subsystem findings: ``io_bound`` keeps
    what ``metadata_storm`` and ``io_bandwidth`` leave (reported while that is still its
    ``min_share``), and ``startup`` is dropped when ``launch_overhead`` prices the job's start
    (job start to the last rank's first work holds the startup window)."""
    out = []
    for f in findings:
        causes = [c for c in findings if c.kind in role_of(f.kind).explained_by
                  and not (replayed(c) and replayed(f))]  # fmt: skip
        if not causes:
            out.append(f)
            continue
        before = float(f.cost_s)
        if f.kind == "startup":
            for c in causes:
                c.evidence.setdefault("includes", {})["startup"] = round(before, 4)
            continue
        taken = sum(float(c.cost_s) for c in causes)
        f.cost_s = max(0.0, before - taken)
        f.evidence["deduplicated"] = {"cost_before_s": round(before, 4),
                                      "explained_by": {c.kind: round(min(before, float(c.cost_s)), 4) for c in causes}}  # fmt: skip
        for c in causes:
            c.evidence.setdefault("includes", {})[f.kind] = round(min(before, float(c.cost_s)), 4)
        if f.cost_s >= float(cfg.value(f.kind, "min_share", 0.1)) * wall_s:
            out.append(f)
    return out


#: breakdown column -> the finding kinds that explain time in it (coverage, "never silent")
EXPLAINS: dict[str, tuple[str, ...]] = {
    "compute_s": ("compute_bound", "straggler", "serial_section", "gpu_underutilized"),
    "startup_s": ("startup", "launch_overhead"),
    "comm_wait_s": ("straggler", "serial_section", "input_bound", "h2d_copy", "metadata_storm", "io_bandwidth",
                    "io_bound", "startup", "slow_link", "network_bound", "hang", "collective_mismatch",
                    "launch_overhead", "compute_bound", "load_imbalance", "small_collectives"),
    "comm_transfer_s": ("network_bound", "slow_link", "small_collectives"),
    "io_s": ("io_bound", "metadata_storm", "io_bandwidth", "startup"),
    "input_wait_s": ("input_bound",),
    "h2d_s": ("h2d_copy",),
    "other_s": ("slow_link", "hang", "network_bound", "load_imbalance"),
}  # fmt: skip
#: what binds, in words, when a category holds the run and no finding explains it
BINDS = {
    "compute_s": "compute: the ranks' own work holds the run (speed up the kernels, or spread the work "
                 "over more ranks); no peak throughput is known to price it",
    "startup_s": "startup: imports, init and setup before the first step hold the run (run longer per "
                 "launch to amortize it, cache what the setup builds)",
    "comm_wait_s": "waiting in collectives with no rank late most of the time: load imbalance that moves "
                   "between ranks (look at the per-step view)",
    "comm_transfer_s": "collective transfers hold the run (the network, or too many small collectives)",
    "io_s": "file I/O holds the run during startup or in calls no rank waited for",
    "input_wait_s": "the data loader holds the run (more workers, prefetch)",
    "h2d_s": "host-to-device copies hold the run (pinned memory, non_blocking copies)",
    "other_s": "other calls (point-to-point, waits, communicator creation) hold the run",
}  # fmt: skip


def _transfer_binds(colls: Collectives | None, cfg: Config) -> str:
    """What binds, in words, when collective transfers hold the run and no finding explains them:
    :data:`BINDS`' line with what the collectives were, measured in one pass over the groups (no
    sort of the member rows): how many moved bytes after their last arrival, the size (bytes a
    member) under which half of that time went, and the median time a call. Small ones (under
    ``[analyze.small_collectives] max_bytes``) cost their per-call latency whatever they carry; called back to
    back they are ``small_collectives``' (which then explains them), so here they have work between
    them (a step's one all-reduce, which the next step's needs): overlap or call less often."""
    from distdiag.links import small_limits, tail_ns
    from distdiag.match import MatchState

    base = BINDS["comm_transfer_s"]
    if colls is None or len(colls) == 0 or len(colls.m_t1_ns) == 0:
        return base
    xfer = tail_ns(colls)
    ok = (colls.g_state == MatchState.COMPLETE) & (colls.g_n_members >= 2) & (xfer > 0)
    if not ok.any():
        return base
    x = xfer[ok].astype(np.float64)
    nb = colls.m_nbytes.group_max()[ok]
    o = np.argsort(nb, kind="stable")
    half = int(np.searchsorted(np.cumsum(x[o]), x.sum() / 2))
    size = int(nb[o][min(half, len(o) - 1)])
    per_call = float(np.median(x)) / 1e3  # us
    what = (f"{int(ok.sum()):,} collectives; half of their transfer time in calls of {size:,} bytes a member "
            f"or less, {per_call:.3g} us a call (median)")
    if size <= small_limits(cfg)[0]:
        return (f"collective transfers hold the run, in small calls between the ranks' work: {what}; each "
                "costs its latency whatever it carries: overlap them with the work (non-blocking "
                "collectives), call less often, or measure the links (`distdiag-wrap --probe-links`)")
    return (f"{base}: {what}; measure the links (`distdiag-wrap --probe-links`), or communicate less or "
            "overlap it")


def coverage(findings: list[Finding], breakdown: Any, run: Run, cfg: Config,
             colls: Collectives | None = None) -> list[dict[str, Any]]:
    """"Never silent" (issue 20 item 2): each breakdown category that holds more than
    ``[analyze.coverage] min_share`` (0.1) of some rank's wall-clock, with the findings that explain
    it (:data:`EXPLAINS`) or, when none does, what binds (:data:`BINDS`).

    A category is measured on its most-held rank (a single rank reading files for half the
    run holds the job though the others' share is small). What the ``startup``
    counterfactual keeps (its floor, :func:`distdiag.startup_floor.floor_of`: the imports, their
    file calls in ``io_s``, ``MPI_Init`` in ``other_s``) explains its categories when it
    holds all but ``min_share`` of them (the startup category: when what the counterfactual
    removes, its ``cost_s``, is under ``min_share``): a short MPI job's 0.4 s in
    MPI_Init is no finding.
    Entries: ``{"category", "share", "rank", "seconds", "explained_by": [...], "binds": str|None}``; with
    ``colls``, the line for collective transfers says what they were (:func:`_transfer_binds`)."""
    share_min = float(cfg.value("coverage", "min_share", 0.1))
    if breakdown is None or len(breakdown) == 0:
        return []
    wall = breakdown["wall_s"].to_numpy(np.float64)
    safe = np.where(wall > 0, wall, 1.0)
    kinds = {f.kind for f in findings}
    fl = floor_of(run, cfg)
    floor = fl.kept if fl is not None else None
    startup_cost = fl.cost_s if fl is not None else None
    out = []
    for col, explainers in EXPLAINS.items():  # eight categories
        if col not in breakdown:
            continue
        v = breakdown[col].to_numpy(np.float64)
        sh = v / safe
        i = int(np.argmax(sh))
        if sh[i] <= share_min:
            continue
        rank = int(breakdown["rank"].iloc[i])
        by = [k for k in explainers if k in kinds]
        kept = float(floor.get(rank, {}).get(col, 0.0)) if isinstance(floor, dict) else 0.0
        if col == "startup_s" and startup_cost is not None:
            # job-wide: a rank that waited for another's imports (at its first, unrecorded
            # rendezvous: DDP's constructor) is held by that rank's floor, not its own
            ok = float(startup_cost) <= share_min * wall[i]
        else:
            ok = v[i] - kept <= share_min * wall[i]
        if not by and kept > 0 and ok:
            what = {"startup_s": "imports", "io_s": "imports' file calls", "other_s": "MPI_Init",
                    "comm_wait_s": "the wait at the first collective for the last rank's imports and MPI_Init"}.get(col, col)
            by.append(f"startup floor: {what} ({kept:.3g} s, kept by the startup counterfactual)")
        binds = None if by else _transfer_binds(colls, cfg) if col == "comm_transfer_s" else BINDS.get(col)
        out.append({"category": col, "share": round(float(sh[i]), 4), "rank": rank, "seconds": round(float(v[i]), 4),
                    "explained_by": by, "binds": binds})  # fmt: skip
    return out


def unpriced_binding(cov: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The costliest entry of a :func:`coverage` that holds a rank's run with no finding to explain
    it, compute aside (a balanced job that computes most of the time is a healthy one); None when
    there is none. With no finding, such a category means the job is not healthy, only unpriced:
    the renderers' verdict says so instead of "healthy"."""
    got = [c for c in cov if c.get("binds") and c.get("category") != "compute_s"]
    return max(got, key=lambda c: float(c["share"])) if got else None


def _charge_lost_runs(findings: list[Finding], run: Run, wall_s: float) -> None:
    """A finding that ended the job (``evidence["ends_job"]``: a hang, a fatal mismatch) costs the whole run.

    A job that never finishes produced no result: removing that cause saves the
    rerun, i.e. all of its wall-clock (its turnaround, queue included, when
    Slurm accounting is at hand, since a resubmitted job queues again). The
    seconds the ranks sat stuck, which the detector measured as its cost, stay
    in ``evidence["stuck_wait_s"]``. Charged this way the contract's plain
    order by ``cost_s`` puts it first, as the issue of hangs asks: nothing else
    is worth fixing while the job does not finish.

    Worked example: a 100 s run whose ranks wait in Barrier #5 from 40 s on
    until killed, and a straggler that cost 30 s before that: hang 100 s
    (stuck 60 s), then straggler 30 s.
    """
    lost_s = wall_s
    try:
        from distdiag.slurm import accounting_of

        turnaround = accounting_of(run).turnaround_s
        if turnaround:
            lost_s = max(lost_s, float(turnaround))
    except Exception:  # no accounting: the run's own wall-clock
        pass
    for f in findings:
        if f.evidence.get("ends_job"):
            f.evidence.setdefault("stuck_wait_s", float(f.cost_s))
            f.cost_s = max(float(f.cost_s), lost_s)
            if lost_s > wall_s:
                f.evidence["fraction_of"] = "turnaround"
                f.evidence["turnaround_s"] = lost_s


def outlook(findings: list[Finding], wall_s: float, limit: int = 3) -> list[dict[str, Any]]:
    """What binds after fixing the findings above it, one entry per finding (the first ``limit``).

    Entry i: ``wall_s`` of the run with findings 0..i-1 fixed, and finding i's
    share of that shorter run. Only findings on the ranks' wall-clock count
    (the queue does not shorten the run).
    """
    out = []
    left = wall_s
    for f in findings[:limit]:  # a handful
        on_run = f.evidence.get("fraction_of") != "turnaround"
        share = float(f.cost_s) / left if on_run and left > 0 else f.fraction
        out.append({"kind": f.kind, "cost_s": float(f.cost_s), "wall_s": left, "share": share})
        if on_run:
            left = max(0.0, left - float(f.cost_s))
    return out


# ----------------------------------------------------------------------------------


def _deduplicate(findings: list[Finding], run: Run, colls: Collectives, cfg: Config, wall_s: float) -> list[Finding]:
    tier = {f.kind: role_of(f.kind).tier for f in findings}
    symptoms = [f for f in findings if tier[f.kind] in (1, 2)]
    causes = [f for f in findings if tier[f.kind] in (0, 1)]
    if not symptoms or not causes:
        return list(findings)
    dropped: set[int] = set()
    for f in sorted(symptoms, key=lambda f: tier[f.kind] or 0):  # few findings
        win = f.windows(run, colls) if f.windows is not None else None  # made by its detector
        if win is None:
            continue
        before = float(f.cost_s)
        taken: dict[str, float] = {}
        all_claims = []
        for c in causes:  # few
            if c is f or (tier[c.kind] or 0) >= (tier[f.kind] or 0) or id(c) in dropped:
                continue
            if replayed(c) and replayed(f):  # the replay counted their seconds once already
                continue
            claims = claims_of(c, run)
            if claims is None:
                continue
            all_claims.append(claims)
            ov_s = _explained_ns(win, claims) / 1e9
            ov_s = min(ov_s, float(c.cost_s))
            if ov_s <= 0:
                continue
            label = f"{c.kind} ranks {','.join(map(str, c.ranks))}" if c.ranks else c.kind
            taken[label] = taken.get(label, 0.0) + ov_s
            c.evidence.setdefault("includes", {})[f"{f.kind} ranks {','.join(map(str, f.ranks))}"] = round(ov_s, 4)
        if not taken:
            continue
        # Causes can claim the same seconds (a serial section that writes a
        # checkpoint, and the write): what they take together is what the
        # union of their claims explains, never the sum.
        union = tuple(np.concatenate(x) for x in zip(*all_claims))
        total = min(before, sum(taken.values()), _explained_ns(win, union) / 1e9)  # type: ignore[arg-type]
        f.cost_s = before - total
        f.evidence["deduplicated"] = {"cost_before_s": round(before, 4),
                                      "explained_by": {k: round(v, 4) for k, v in taken.items()}}  # fmt: skip
        thr = float(cfg.value(f.kind, "min_fraction", getattr(cfg, "min_fraction", 0.02)))
        if f.cost_s < thr * wall_s:
            log.info("%s ranks %s: %.3f s of %.3f s explained by %s; dropped", f.kind, f.ranks, total, before, taken)
            dropped.add(id(f))
    return [f for f in findings if id(f) not in dropped]


def _explained_ns(win: Windows, claims: tuple[np.ndarray, np.ndarray, np.ndarray]) -> float:
    """Sum over windows of min(charge, length of the window covered by the claims on its rank).

    The claims are merged per rank into disjoint segments on one axis (each
    rank in its own band, so one sort does all ranks); the covered length up
    to each window edge, by prefix sums, gives each window's overlap without a
    loop over events. Worked example: a window [0, 30] ms charged 20 ms, claims
    [0, 5] and [25, 40]: overlap 10 ms, explained 10 ms.
    """
    wr, w0, w1, charge = win
    cr, c0, c1 = claims
    if len(wr) == 0 or len(cr) == 0:
        return 0.0
    lo = int(min(w0.min(), c0.min()))
    span = int(max(w1.max(), c1.max())) - lo + 1
    cs, ce = union_banded(cr, c0 - lo, c1 - lo, span)
    a = wr * span + (w0 - lo)
    b = wr * span + (np.maximum(w1, w0) - lo)
    ov = covered_within(cs, ce, a, b)
    return float(np.minimum(ov, np.maximum(charge, 0)).sum())
