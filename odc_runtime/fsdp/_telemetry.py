"""FSDP ODC mode's minibatch figures (``odc_runtime.telemetry``): each minibatch, from ``begin_minibatch`` to the
end of ``end_minibatch``, is one telemetry minibatch of this rank (a line of the ``ODC_TRACE_DIR`` trace), and its
record is what ``odc_runtime.fsdp.stats(model)["last_minibatch"]`` returns."""

from __future__ import annotations

from odc_runtime import telemetry

from ._layout import State


def open_window(state: State) -> None:
    """The minibatch starts: its telemetry window, and every unit's reduce-scatter count (to count backwards)."""
    state.window = telemetry.begin_minibatch()
    state.rs_base = [unit.reduce_scatters for unit in state.units]


def close_window(state: State, *, ended: bool = False) -> None:
    """Close the minibatch's window. ``ended`` (its closing sync passed, even if its gradients are then refused):
    record it, i.e. ``state.last_minibatch`` and a trace line, with this rank's ``micro_batches`` (backward passes),
    ``sync_wait_s`` (host seconds in its two ``odc.sync`` calls: waiting for the other ranks), ``fetches``,
    ``pushes``, ``syncs``, ``fetch_bytes``, ``push_bytes``, ``start`` / ``end`` (wall-clock seconds) and the rest of
    a trace line (``odc_runtime.telemetry.make_record``). Otherwise (the minibatch failed) drop it."""
    window, state.window = state.window, None
    if window is None:
        return
    if not ended:
        telemetry.abandon_minibatch(window)
        return
    # a micro-batch is a backward pass: it reduce-scatters every unit it reached once (a frozen unit never)
    micro_batches = max((u.reduce_scatters - b for u, b in zip(state.units, state.rs_base, strict=True)), default=0)
    state.last_minibatch = telemetry.end_minibatch(window, micro_batches)
