"""Launching a Triton kernel at a compiled kernel's host cost (installed as ``odc_runtime.kernels.launch``).

``kernel[grid](*args, **constexprs)`` runs Triton's whole binder on every call (knobs, device and stream queries,
argument specialisation, the cache key, the globals check): 9-31 µs of host time per launch, measured. A
``CachedKernel`` pays that once per *argument signature*: the first launch goes through ``kernel[grid]``
(which compiles and returns the ``CompiledKernel``), later launches with the same signature call that kernel's
runner directly with raw pointers and the current stream. ``CachedKernel.bind`` goes one step further for a
caller that repeats one launch (a transfer plan, per caller tensor): the runner with every argument bound, so a
launch is the hook check and one call.

The signature is what Triton specialises a compiled kernel on, so the fast path never runs code compiled for a
specialisation its arguments do not have: each tensor's dtype and 16-byte alignment, each int's width (i32, i64,
u64) and whether it is 1 or a multiple of 16 (kept even for ``do_not_specialize`` arguments: a few more entries,
never a wrong one), each float as a float, and the constexprs. Triton's own ``kernel[grid]`` is used on every call
instead where the fast path does not apply: under the interpreter, while a launch hook is set (profilers hook
Triton's path), and on a Triton line whose runner convention is not the one below (``runner_supported``).

The runner convention, read from the sources of triton 3.5.1, 3.6.0 and 3.9.0 (``CompiledKernel.run`` as
``JITFunction.run`` calls it)::

    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, launch_enter_hook, launch_exit_hook, *every_bound_argument)

where the bound arguments are every parameter in order, constexprs included (the launcher skips them), and a
pointer may be a Python int (the launcher takes an int as the device address).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.runtime import driver as _driver

__all__ = ["RUNNER_LINES", "CachedKernel", "runner_supported"]

Launch = Callable[..., None]

RUNNER_LINES = ((3, 5), (3, 6), (3, 7), (3, 8), (3, 9))  # triton lines whose runner takes the convention above
_LINE = tuple(int(x) for x in triton.__version__.split(".")[:2])
_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)
INTERPRET = bool(_KNOBS is not None and _KNOBS.interpret)
_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)


def runner_supported(line: tuple[int, ...] = _LINE) -> bool:
    """Whether the fast path may call compiled kernels' runners on this Triton line (else ``kernel[grid]``)."""
    return line in RUNNER_LINES and _KNOBS is not None and not INTERPRET


def _hooked(hook: object) -> bool:
    """Whether a launch hook is installed (triton 3.6+ keep an empty ``HookChain`` there; older lines ``None``)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _kind(a: object) -> object:
    """What Triton specialises a compiled kernel on for one runtime argument (see the module docstring)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return bool, a
    if isinstance(a, int):
        width = 32 if _I32[0] <= a < _I32[1] else 64 if _I64[0] <= a < _I64[1] else 65
        return width, a == 1, a % 16 == 0
    if isinstance(a, float):
        return float
    return type(a), a  # None and the like: specialised by value


class CachedKernel:
    """One ``@triton.jit`` kernel launched through its compiled runner once compiled for a signature."""

    __slots__ = ("_cache", "_fast", "_order", "kernel", "launches")

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._fast = runner_supported()
        self._cache: dict[tuple, tuple[Callable[..., Any], Any, Any, tuple]] = {}
        self._order: tuple[str, ...] = tuple(getattr(kernel, "arg_names", ()))
        self.launches = [0, 0]  # (through triton's binder, through the cached runner): for tests and benchmarks

    def __call__(self, grid: tuple[int, ...], *args: object, **constexprs: object) -> None:
        """``kernel[grid](*args, **constexprs)``: ``args`` are the runtime parameters in order, ``constexprs`` the
        rest by name."""
        if not self._fast or _hooked(_KNOBS.launch_enter_hook) or _hooked(_KNOBS.launch_exit_hook):
            self.launches[0] += 1
            self.kernel[grid](*args, **constexprs)
            return
        active = _driver.active
        device = active.get_current_device()
        # per device, as Triton's own cache: a compiled kernel's function handle belongs to one device (and one
        # target: the launch check compiles for several with fake drivers in one process)
        key = (device, *map(_kind, args), *constexprs.items())
        hit = self._cache.get(key)
        if hit is None:
            self.launches[0] += 1
            self._remember(key, self.kernel[grid](*args, **constexprs), len(args), constexprs)
            return
        run, function, metadata, tail = hit
        raw = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        self.launches[1] += 1
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            active.get_current_stream(device), function, metadata, None, None, None, *raw, *tail)

    def bind(self, grid: tuple[int, ...], args: tuple, late: tuple[float | int, ...] = (), stream: int | None = None,
             after: tuple = (), **constexprs: object) -> Launch | None:
        """``self(grid, *args, *late, *after, **constexprs)`` made ready to repeat: ``launch(*late)`` calls the
        compiled runner with ``args``' and ``after``'s raw pointers, fixed now, and the ``late`` value given at each
        call (at most one). ``late`` holds a float (a float's value is never specialised, so any float is the same
        signature) or an int for a parameter the kernel declares ``do_not_specialize`` (only its width is: a value
        of another width than the bound one launches through ``__call__``). ``stream``: the raw stream to launch on
        (``None``: the driver's current stream now, for a caller without streams of its own: a CPU transport under
        a stubbed driver).

        ``None`` where the fast path does not apply: under the interpreter, on a Triton line with another runner,
        or before the signature was launched once through ``__call__`` (which compiles it). The caller keeps
        ``args``' tensors alive while it keeps the launch (the launch holds them too, for its fallback). While a
        launch hook is set, the launch goes through Triton's path, as ``__call__`` does."""
        if len(late) > 1 or not all(type(x) is float or (type(x) is int and self._unspecialised(len(args)))
                                    for x in late):
            raise TypeError("CachedKernel.bind: at most one late argument, a float or an int of a do_not_specialize "
                            "parameter (its value is not specialised)")
        if not self._fast:
            return None
        active = _driver.active
        device = active.get_current_device()
        if late and type(late[0]) is int and not _I32[0] <= late[0] < _I32[1]:
            return None  # only an i32 late int is bound (the values of its width: one range check per launch)
        hit = self._cache.get((device, *map(_kind, args), *map(_kind, late), *map(_kind, after),
                               *constexprs.items()))
        k = _KNOBS
        enter, leave = k.launch_enter_hook, k.launch_exit_hook
        if hit is None or not all(h is None or isinstance(getattr(h, "calls", None), list) for h in (enter, leave)):
            return None  # not compiled yet, or a hook that is not Triton's chain (go through Triton's path)
        run, function, metadata, tail = hit
        gx, gy, gz = (*grid, 1, 1)[:3]
        front = (gx, gy, gz, active.get_current_stream(device) if stream is None else stream, function, metadata,
                 None, None, None, *(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))
        counts = self.launches
        # The hooks are idle while the knobs hold the objects seen now and those (``None`` or Triton's chains, which
        # add/remove mutate in place) have no call: their lists are kept to test that with no lookup per launch.
        enter_calls = () if enter is None else enter.calls
        leave_calls = () if leave is None else leave.calls
        back = (*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in after), *tail)
        # The runner's whole argument tuple, made once: ``run(*argv)`` passes it as it is (a partial with more
        # arguments, or a tuple built per call, costs about 0.1 µs more per launch).
        argv = (*front, *late, *back)

        if late:
            slot = len(front)  # the late argument's place in argv
            check_int = type(late[0]) is int  # then every i32 value shares the compiled kernel, no other one
            lo, hi = _I32

            def launch(last: float | int) -> None:
                nonlocal argv
                if enter_calls or leave_calls or k.launch_enter_hook is not enter or k.launch_exit_hook is not leave \
                        or (check_int and not (type(last) is int and lo <= last < hi)):
                    self(grid, *args, last, *after, **constexprs)  # a hook (Triton's path, where it runs), or
                    return  # an int of another width (another compiled kernel)
                counts[1] += 1
                # A repeated value (a push's constant scale) reuses the tuple: equal non-zero floats have the same
                # bits, while 0.0 == -0.0 (and NaN != NaN) make a new one. One read of argv, so a launch from another
                # thread that replaces it cannot pair this value with another's tuple.
                ready = argv
                if last != ready[slot] or last == 0.0:
                    ready = argv = (*front, last, *back)
                run(*ready)

            return launch

        def launch_fixed() -> None:
            if enter_calls or leave_calls or k.launch_enter_hook is not enter or k.launch_exit_hook is not leave:
                self(grid, *args, *after, **constexprs)
                return
            counts[1] += 1
            run(*argv)

        return launch_fixed

    def _unspecialised(self, index: int) -> bool:
        """Whether the kernel's parameter ``index`` is declared ``do_not_specialize`` (Triton's ``KernelParam``, the
        same attribute in triton 3.5-3.9)."""
        params = getattr(self.kernel, "params", ())
        return index < len(params) and bool(getattr(params[index], "do_not_specialize", False))

    def _remember(self, key: tuple, compiled: Any, nargs: int, constexprs: dict[str, object]) -> None:
        """Keep ``compiled``'s runner for ``key`` if it has the runner convention; else launch through Triton's
        binder from now on (a Triton whose compiled kernels differ)."""
        try:
            run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
            tail = tuple(constexprs[name] for name in self._order[nargs:])
        except (AttributeError, KeyError):
            self._fast = False
            return
        self._cache[key] = (run, function, metadata, tail)
