"""The patch registry: one record per patch, one way to apply, undo and report them.

A patch is applied only when its behavioural probe, run on the live aphrodite modules, says the
installed code still has the bug. No version string is consulted (vllm-ascend's weak spot: exact
version gates broke on ``+local`` and dev builds). Every replacement keeps the raw original from
the owner's ``__dict__`` (so a ``staticmethod`` stays a ``staticmethod``, as in pytest's
MonkeyPatch) on one undo stack, and every replacement is tagged so a second ``apply`` changes
nothing (as gevent.monkey's ``saved``).

Statuses:
  APPLIED         the probe found the bug, the replacement is installed and the probe now passes.
  UPSTREAM_FIXED  the probe says the installed code is already right: nothing is replaced.
  NOT_APPLICABLE  aphrodite is not installed, or the probe found the feature absent (no compiled
                  kernels): nothing to do.
  DRIFTED         a target is missing, or its shape differs from what the patch was written
                  against: nothing is replaced, a WARNING names what differed, the engine runs on.
  DISABLED        switched off by HYBRID_EXL3_FIXES_DISABLE.
  FAILED          applying raised, or the probe still saw the bug afterwards: rolled back.
  BROKEN_INSTALL  aphrodite is installed but a module the patch targets cannot be imported because a
                  package aphrodite needs is missing (or of a wrong version): the user's environment,
                  not upstream, is what changed; the message names the package.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A child of aphrodite's logger, so the lines reach the handler aphrodite configures in every
# process it starts; without aphrodite, Python's last-resort handler still prints WARNINGs.
logger = logging.getLogger("aphrodite.hybrid_exl3_fixes")

DISABLE_ENV = "HYBRID_EXL3_FIXES_DISABLE"
MARKER = "__hybrid_exl3_fixes_patch__"


class Status(str, enum.Enum):
    APPLIED = "APPLIED"
    UPSTREAM_FIXED = "UPSTREAM_FIXED"
    NOT_APPLICABLE = "NOT_APPLICABLE"
    DRIFTED = "DRIFTED"
    DISABLED = "DISABLED"
    FAILED = "FAILED"
    BROKEN_INSTALL = "BROKEN_INSTALL"


class Drift(Exception):
    """A target is not what the patch was written against; the message says what differs."""


class UndoOrder(RuntimeError):
    """``undo`` of a patch that a later one still wraps or replaced over: undoing it first would restore the state
    before both and leave the later one's result claiming APPLIED."""


class BrokenInstall(Exception):
    """An aphrodite module cannot be imported because a package outside aphrodite is missing or broken."""


def opted_in(environ, name: str) -> bool:
    """An opt-in switch of this overlay (P12's, P13's) set: ``1``, ``true``, ``on`` or ``yes``."""
    return (environ.get(name) or "").strip().lower() in ("1", "true", "on", "yes")


def classify_import_error(module: str, exc: ImportError) -> Exception:
    """BrokenInstall when the module that failed is not aphrodite's own (a missing dependency),
    Drift when aphrodite's own module is missing or lacks a name (upstream moved something)."""
    missing = getattr(exc, "name", None) or ""
    if missing and missing != "aphrodite" and not missing.startswith("aphrodite."):
        package = missing.split(".")[0]
        what = "is not installed" if isinstance(exc, ModuleNotFoundError) else f"does not provide what it needs ({exc})"
        return BrokenInstall(
            f"aphrodite's {module} cannot be imported: the package {package!r} it needs {what}. The "
            f"aphrodite install is incomplete: pip install {package} (or reinstall aphrodite-engine "
            "with its dependencies)"
        )
    return Drift(f"cannot import {module}: {exc}")


class NotApplicable(Exception):
    """Raised by a probe when the feature the patch fixes is absent from this install (for
    example no compiled kernels); the message says what is missing."""


@dataclass(frozen=True)
class Target:
    """One attribute the patch replaces.

    ``binds`` names the defining target when this module holds a ``from x import y`` copy of
    it: such a copy must be the very same object, or the module has drifted.
    ``params`` is the parameter list the replacement was written against (``None``: a
    property or non-callable, checked by kind only); ``also`` lists other parameter lists the
    replacement takes as they are (a method that gained a parameter in a later release).
    """

    module: str
    qualname: str
    params: tuple[str, ...] | None = None
    binds: str | None = None
    also: tuple[tuple[str, ...], ...] = ()

    @property
    def key(self) -> str:
        return f"{self.module}.{self.qualname}"


@dataclass
class Live:
    """A resolved target: where it lives and what is there now."""

    target: Target
    owner: Any
    name: str
    raw: Any  # as stored in the owner's __dict__ (staticmethod, property, function)
    value: Any  # as attribute access returns it

    @property
    def function(self) -> Any:
        raw = self.raw
        if isinstance(raw, (staticmethod, classmethod)):
            return raw.__func__
        if isinstance(raw, property):
            return raw.fget
        return raw


@dataclass(frozen=True)
class Patch:
    id: str
    slug: str
    title: str
    upstream: str  # PR link, or where the report lives
    fixed_in: str | None  # first aphrodite release with the fix upstream
    retire_when: str
    targets: tuple[Target, ...]
    # probe(live) -> True when the installed code has the bug; raise Drift when the answer
    # is neither the buggy nor the fixed one.
    probe: Callable[[dict[str, Live]], bool]
    # build(live) -> {target key: new raw object}; only called when the probe found the bug.
    build: Callable[[dict[str, Live]], dict[str, Any]]
    # A stale ``from x import y`` copy may sit in modules nobody listed (plugins, newer
    # aphrodite files): replace those too when they hold the exact original function.
    scan_stale_copies_of: tuple[str, ...] = ()
    # on_undo() -> None: the patch's own runtime state (caches, objects it changed after apply, at load time)
    # back to what it was before apply; called by undo after the replaced attributes are restored
    on_undo: Callable[[], None] | None = None
    # True where the probe run after apply recognises the patch by its tag on the replaced function instead of
    # exercising the fix (P3, P9, P10: the bug lives in a GPU kernel's inputs; the CPU suite and the GPU drop-ins
    # test the behaviour); the APPLIED result says so
    checks_tag_after_apply: bool = False
    # the patches that must be applied before this one, each for a reason its docstring states (a later patch wraps
    # what an earlier one installed on the same target, or reads what it set at load time)
    after: tuple[str, ...] = ()
    # what a user sees without the patch, in a line (the README's patch table is made from it)
    symptom: str = ""
    # the environment variable that turns an opt-in patch on; None for a patch that applies wherever its probe
    # finds the bug
    opt_in: str | None = None


# the statuses under which the engine runs without a fix and the user should hear of it
PROBLEM_STATUSES = (Status.DRIFTED, Status.FAILED, Status.BROKEN_INSTALL)


@dataclass
class Result:
    patch: Patch
    status: Status
    reason: str
    replaced: list[str] = field(default_factory=list)

    @property
    def is_problem(self) -> bool:
        """DRIFTED, FAILED or BROKEN_INSTALL: the engine runs without this fix and the user should hear of it."""
        return self.status in PROBLEM_STATUSES

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.patch.id,
            "slug": self.patch.slug,
            "status": self.status.value,
            "upstream": self.patch.upstream,
            "fixed_in": self.patch.fixed_in,
            "reason": self.reason,
            "replaced": list(self.replaced),
        }


@dataclass
class _Saved:
    owner: Any
    name: str
    raw: Any
    had_own: bool  # the attribute was in the owner's own __dict__ (else it was inherited)


def patch_number(patch_id: str) -> tuple[int, str]:
    """Display order, P1 < P2 < P2b < ... < P11 (the registry applies P9 before P7, which wraps it)."""
    digits = "".join(c for c in patch_id[1:] if c.isdigit())
    return int(digits or 0), patch_id


class Registry:
    def __init__(self, patches: list[Patch]):
        self.patches = patches
        self.results: dict[str, Result] = {}
        # one stack across patches, in the order they were applied: undo is last in, first out
        self._stack: list[tuple[str, list[_Saved]]] = []

    # -- switches -------------------------------------------------------------------------
    @staticmethod
    def disabled_ids() -> set[str] | None:
        """``None``: nothing disabled; an empty set means all (``=1``/``all``)."""
        raw = os.environ.get(DISABLE_ENV, "").strip()
        if not raw or raw.lower() in ("0", "false", "no"):
            return None
        if raw.lower() in ("1", "true", "yes", "all"):
            return set()
        return {part.strip().upper() for part in raw.split(",") if part.strip()}

    def unknown_disabled(self) -> list[str]:
        """The entries of the off switch that name no patch of this registry (by id or slug, any case), as the user
        wrote them: ``P99``, ``P1;P2`` (ids are separated by commas). Such an entry switches nothing off."""
        ids = self.disabled_ids()
        if not ids:
            return []
        known = {p.id.upper() for p in self.patches} | {p.slug.upper() for p in self.patches}
        parts = (part.strip() for part in os.environ.get(DISABLE_ENV, "").split(","))
        return [part for part in parts if part and part.upper() not in known]

    def _is_disabled(self, patch: Patch) -> bool:
        ids = self.disabled_ids()
        return ids is not None and (not ids or patch.id.upper() in ids or patch.slug.upper() in ids)

    # -- resolution -----------------------------------------------------------------------
    @staticmethod
    def _resolve(target: Target) -> Live:
        try:
            obj: Any = importlib.import_module(target.module)
        except ImportError as exc:
            raise classify_import_error(target.module, exc) from exc
        except Exception as exc:  # a module that raises on import is drift too, never a crash
            raise Drift(f"importing {target.module} raised {type(exc).__name__}: {exc}") from exc
        parts = target.qualname.split(".")
        for part in parts[:-1]:
            if not hasattr(obj, part):
                raise Drift(f"{target.module} has no {part!r} (looked for {target.qualname})")
            obj = getattr(obj, part)
        name = parts[-1]
        if not hasattr(obj, name):
            raise Drift(f"{target.module} has no {target.qualname}")
        raw = None
        for klass in inspect.getmro(obj) if inspect.isclass(obj) else (obj,):
            if name in vars(klass):
                raw = vars(klass)[name]
                break
        return Live(target, obj, name, raw, getattr(obj, name))

    @staticmethod
    def _check_shape(live: dict[str, Live], patch: Patch) -> None:
        for target in patch.targets:
            item = live[target.key]
            if target.binds is not None:
                origin = live[target.binds]
                if item.value is not origin.value:
                    raise Drift(
                        f"{target.key} is not the object defined at {target.binds} "
                        "(the module no longer imports it by name, or something else replaced it)"
                    )
                continue
            if target.params is None:
                if not isinstance(item.raw, property):
                    raise Drift(f"{target.key} is a {type(item.raw).__name__}, expected a property")
                continue
            try:
                params = tuple(inspect.signature(item.function).parameters)
            except (TypeError, ValueError) as exc:
                raise Drift(f"{target.key} has no readable signature: {exc}") from exc
            if params != target.params and params not in target.also:
                raise Drift(
                    f"{target.key} takes ({', '.join(params)}), the patch was written for ({', '.join(target.params)})"
                )
            if "." in target.qualname:  # a method: its kind follows from the first parameter
                first = params[0] if params else None
                kind = {"self": "function", "cls": "classmethod"}.get(first, "staticmethod")
                now = type(item.raw).__name__ if isinstance(item.raw, (staticmethod, classmethod)) else "function"
                if now != kind:
                    raise Drift(f"{target.key} changed kind: now a {now}, the patch was written for a {kind}")

    # -- apply / undo ---------------------------------------------------------------------
    def apply(self, patch: Patch) -> Result:
        done = self.results.get(patch.id)
        if done is not None and done.status is Status.APPLIED:
            return done
        result = self._apply(patch)
        self.results[patch.id] = result
        return result

    def _apply(self, patch: Patch) -> Result:
        if self._is_disabled(patch):
            return Result(patch, Status.DISABLED, f"switched off by {DISABLE_ENV}")
        if importlib.util.find_spec("aphrodite") is None:
            return Result(patch, Status.NOT_APPLICABLE, "aphrodite is not installed")
        try:
            live = {t.key: self._resolve(t) for t in patch.targets}
        except Drift as exc:
            return Result(patch, Status.DRIFTED, str(exc))
        except BrokenInstall as exc:
            return Result(patch, Status.BROKEN_INSTALL, str(exc))
        if all(patch.id in tags_of(item.raw) for item in live.values() if item.target.binds is None):
            return Result(patch, Status.APPLIED, "already patched in this process")
        try:
            has_bug = patch.probe(live)
        except Drift as exc:
            return Result(patch, Status.DRIFTED, f"probe: {exc}")
        except NotApplicable as exc:
            return Result(patch, Status.NOT_APPLICABLE, str(exc))
        except ImportError as exc:  # the probe imports aphrodite modules too
            found = classify_import_error(getattr(exc, "name", None) or "a module", exc)
            status = Status.BROKEN_INSTALL if isinstance(found, BrokenInstall) else Status.DRIFTED
            return Result(patch, status, f"probe: {found}")
        except Exception as exc:
            return Result(patch, Status.DRIFTED, f"probe raised {type(exc).__name__}: {exc}")
        if not has_bug:
            return Result(
                patch, Status.UPSTREAM_FIXED, "the installed code already behaves correctly; nothing replaced"
            )
        try:
            self._check_shape(live, patch)
        except Drift as exc:
            return Result(patch, Status.DRIFTED, str(exc))

        saved: list[_Saved] = []
        replaced: list[str] = []
        try:
            new = patch.build(live)
            for target in patch.targets:
                item = live[target.key]
                if target.binds is not None:
                    replacement = new[target.binds]
                    replacement = replacement.__func__ if isinstance(replacement, staticmethod) else replacement
                else:
                    replacement = new[target.key]
                saved.append(self._set(item.owner, item.name, replacement))
                replaced.append(target.key)
            for key in patch.scan_stale_copies_of:
                original = live[key].value
                fresh = new[key]
                for mod_name, module in list(sys.modules.items()):
                    if not mod_name.startswith("aphrodite") or module is None:
                        continue
                    for attr, value in list(vars(module).items()):
                        if value is original:
                            saved.append(self._set(module, attr, fresh))
                            replaced.append(f"{mod_name}.{attr} (stale copy)")
            still_buggy = patch.probe({k: self._resolve(v.target) for k, v in live.items()})
        except Exception as exc:
            self._restore(saved)
            return Result(patch, Status.FAILED, f"apply raised {type(exc).__name__}: {exc}; rolled back")
        if still_buggy:
            self._restore(saved)
            return Result(patch, Status.FAILED, "the probe still sees the bug after patching; rolled back")
        self._stack.append((patch.id, saved))
        how = "; checked after apply by its tag, not by behaviour" if patch.checks_tag_after_apply else ""
        return Result(patch, Status.APPLIED, f"replaced {len(replaced)} attribute(s){how}", replaced)

    @staticmethod
    def _set(owner: Any, name: str, value: Any) -> _Saved:
        own = vars(owner)
        saved = _Saved(owner, name, own.get(name), name in own)
        setattr(owner, name, value)
        return saved

    @staticmethod
    def _restore(saved: list[_Saved]) -> None:
        for item in reversed(saved):
            if item.had_own:
                setattr(item.owner, item.name, item.raw)
            else:
                delattr(item.owner, item.name)

    def applied_ids(self) -> list[str]:
        """The patches this registry replaced attributes for, oldest first."""
        return [patch_id for patch_id, _ in self._stack]

    def undo(self, patch: Patch) -> bool:
        """Restore what ``patch`` replaced; False when it replaced nothing here. Raises ``UndoOrder`` (and changes
        nothing) while a patch applied after it is still in place: undo those first, or call ``undo_all``."""
        ids = self.applied_ids()
        if patch.id not in ids:
            return False
        later = ids[ids.index(patch.id) + 1 :]
        if later:
            raise UndoOrder(
                f"{patch.id} cannot be undone while {', '.join(later)} (applied after it) is in place: "
                f"undo {later[-1]} first, or undo all"
            )
        _, saved = self._stack.pop()
        self._restore(saved)
        self.results.pop(patch.id, None)
        if patch.on_undo is not None:
            try:
                patch.on_undo()
            except Exception as exc:  # undo never raises for a patch's state; the attributes are restored already
                logger.warning(
                    "hybrid-exl3-fixes: %s: resetting its state on undo raised %s: %s",
                    patch.id,
                    type(exc).__name__,
                    exc,
                )
        return True

    def undo_all(self) -> list[str]:
        """Undo every applied patch, newest first; returns their ids in that order."""
        by_id = {patch.id: patch for patch in self.patches}
        return [patch_id for patch_id in reversed(self.applied_ids()) if self.undo(by_id[patch_id])]


def in_apply_order(patches: list[Patch]) -> list[Patch]:
    """``patches`` in the order they are applied: each after every patch its ``after`` names, otherwise in the order
    given (patch-id order). ValueError for an ``after`` naming no patch of the list, or a cycle."""
    ids = [p.id for p in patches]
    unknown = sorted({a for p in patches for a in p.after} - set(ids))
    if unknown:
        raise ValueError(f"Patch.after names no known patch: {', '.join(unknown)}")
    done: list[Patch] = []
    left = list(patches)
    while left:
        ready = next((p for p in left if all(a in {d.id for d in done} for a in p.after)), None)
        if ready is None:
            raise ValueError(f"Patch.after has a cycle among {', '.join(p.id for p in left)}")
        done.append(ready)
        left.remove(ready)
    return done


def tags_of(raw: Any) -> set[str]:
    """The ids of the patches whose replacement ``raw`` is, or wraps (a later patch wraps an earlier one's
    replacement: P7 wraps P9 on ``Exl3MoEMethod.apply``). How a probe tells that its own patch, or one it must come
    after, is in place; ``raw`` as the owner's ``__dict__`` holds it (a staticmethod, a property, a function)."""
    fn = raw
    if isinstance(raw, (staticmethod, classmethod)):
        fn = raw.__func__
    elif isinstance(raw, property):
        fn = raw.fget
    return {getattr(f, MARKER) for f in wrapper_chain(fn) if getattr(f, MARKER, None) is not None}


def wrapper_chain(function: Any) -> list:
    """``function`` and every function it wraps (``__wrapped__``), outermost first; at most 16 (never a cycle)."""
    chain = [function]
    while getattr(chain[-1], "__wrapped__", None) is not None and len(chain) < 16:
        chain.append(chain[-1].__wrapped__)
    return chain


def tag(patch_id: str, fn: Callable, original: Callable) -> Callable:
    """Dress a replacement as the function it wraps (name, doc, ``__wrapped__``) and mark it so
    a later apply recognises it as ours."""
    functools.update_wrapper(fn, original)
    setattr(fn, MARKER, patch_id)
    return fn
