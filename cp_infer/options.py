"""Request options as a model declares them: names, types, ranges, defaults and help, in one place.

Invariants:
- A model adapter declares every option a request may set (:class:`ModelOptions`); the HTTP schema, the CLI flags,
  the batch keys and the docs are all derived from that one declaration, so they cannot disagree.
- :meth:`ModelOptions.resolve` is the only way values enter a request: aliases become the declared name, an
  undeclared name is refused naming it, every value is checked against its option's type and range, and every
  option the caller left out gets its declared default. Its errors are ``ValueError`` naming the option and the fix.
- A deployment's limits (``GenerationLimits``) refuse only what the caller gave: a value given over its option's
  limit is refused naming the option, unless the option belongs to a feature that is off (``Option.when``); a
  default over the limit is lowered to the largest value the limit allows (``Option.fit``), so a request that
  names only values within the limits is never refused for a default.
- The engine reads a few options by their standard names (:data:`STANDARD`: what every video model has: frames,
  size, steps, guidance, frame rate, negative prompt); a model declares them with its own defaults. Every other
  option is the model's alone and travels in ``GenerationRequest.options``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STANDARD", "ModelOptions", "Option", "UnknownOption"]

# Declared option name -> the GenerationRequest field that holds it (the engine reads these).
STANDARD: dict[str, str] = {
    "negative_prompt": "negative_prompt",
    "num_frames": "num_frames",
    "height": "height",
    "width": "width",
    "num_inference_steps": "num_inference_steps",
    "guidance_scale": "guidance_scale",
    "frame_rate": "fps",
}

_KINDS = (int, float, str, bool, tuple, list)


@dataclass(frozen=True)
class Option:
    """One request option. Its name is the reference pipeline's argument name wherever one exists."""

    name: str
    kind: type
    """``int``, ``float``, ``str``, ``bool``, ``tuple`` (a list of numbers, of type ``item``) or ``list`` (a list of
    JSON objects, each checked by ``check``)."""
    default: Any
    help: str
    """One line: what it does (the default and range are added where it is shown)."""
    lo: float | None = None
    hi: float | None = None
    """Inclusive range of a number (of each item, for a list)."""
    limit: str | None = None
    """The name of a deployment limit (a ``GenerationLimits`` field) that caps the value instead of ``hi``."""
    when: tuple[str, tuple[Any, ...]] | None = None
    """The option takes part only while option ``when[0]`` has one of the values ``when[1]`` (``cache_interval``:
    ``("cache", ("taylorseer",))``); while it does not, a value given is not checked against ``limit``."""
    fit: Callable[[float, Mapping[str, Any], Any], Any] | None = field(default=None, compare=False)
    """For an option with a ``limit``: ``fit(hi, values, geometry)``, the value a default over the limit ``hi``
    becomes (the largest valid value at most ``hi`` given the other resolved ``values`` and the model's
    ``geometry``, which may be ``None``), or ``None`` when there is none. Unset: ``hi`` (down to ``multiple_of``)."""
    default_for: Callable[[Mapping[str, Any]], Any] | None = field(default=None, compare=False)
    """The default given the other resolved values (those declared before it as resolved); unset: ``default``."""
    nullable: bool = False
    """``None`` is a value (``default`` may then be ``None``: the model decides, as its help says)."""
    multiple_of: int | None = None
    aliases: tuple[str, ...] = ()
    """Other names a request may use for it (older names of this server)."""
    flags: tuple[str, ...] = ()
    """Short command-line flags besides the derived ``--name-with-dashes``."""
    max_items: int = 256
    """For a list: at most this many items."""
    item: type = int
    """For ``tuple``: ``int`` (a list of integers) or ``float`` (a list of numbers)."""
    check: Callable[[Any], None] | None = field(default=None, compare=False)
    """A further check of a resolved value (raises ``ValueError`` naming the option)."""

    def __post_init__(self) -> None:
        assert self.kind in _KINDS, f"{self.name}: kind {self.kind} is not one of {_KINDS}"
        assert self.item in (int, float), f"{self.name}: item {self.item} is not int or float"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def bounds(self, limits: object | None = None) -> tuple[float | None, float | None]:
        hi = self.hi
        if self.limit is not None and limits is not None:
            hi = getattr(limits, self.limit)
        return self.lo, hi

    def applies(self, values: Mapping[str, Any]) -> bool:
        """Whether the option takes part given the resolved ``values`` (:attr:`when`)."""
        return self.when is None or values.get(self.when[0]) in self.when[1]

    def limit_note(self, limits: object | None = None) -> str:
        """How the deployment's limit applies to the option, for its help; empty without one."""
        if self.limit is None:
            return ""
        hi = getattr(limits, self.limit) if limits is not None else None
        cap = f"{_fmt(hi, '')} here" if hi is not None else f"serve's --{self.limit.replace('_', '-')}"
        when = ""
        if self.when is not None:
            when = f", checked only while {self.when[0]} is {' or '.join(map(str, self.when[1]))}"
        return f"{self.limit} is {cap}{when}; a default above it is lowered to the largest value it allows"

    def within_limit(self, value: Any, values: Mapping[str, Any], limits: object | None,
                     geometry: object | None = None) -> Any:
        """``value`` (a default) where it is within the deployment's limit, else what :attr:`fit` lowers it to;
        ``ValueError`` naming the option where no value is within it."""
        if self.limit is None or limits is None or value is None or self.kind not in (int, float):
            return value
        lo, hi = self.bounds(limits)
        if value <= hi:
            return value
        if self.fit is not None:
            fitted = self.fit(hi, values, geometry)
        else:
            fitted = self.kind(hi // self.multiple_of * self.multiple_of if self.multiple_of else hi)
        if fitted is None or (lo is not None and fitted < lo):
            raise ValueError(f"{self.name}: this server's {self.limit}={_fmt(hi, '')} is below every {self.name} the "
                             f"model takes here (its default is {value}); raise --{self.limit.replace('_', '-')}")
        return fitted

    def describe(self, limits: object | None = None) -> str:
        """What the option accepts, for error messages and help: ``an integer in [2, 200]``."""
        lo, hi = self.bounds(limits)
        if hi is None and self.limit is not None:
            hi = self.limit  # named: the deployment sets it
        what = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
                tuple: "a list of integers" if self.item is int else "a list of numbers",
                list: "a list of objects"}[self.kind]
        if self.multiple_of:
            what += f" multiple of {self.multiple_of}"
        if lo is not None or hi is not None:
            what += f" in [{_fmt(lo, '-inf')}, {_fmt(hi, 'inf')}]"
        if self.nullable:
            what += ", or null"
        return what

    def validate(self, value: Any, limits: object | None = None) -> Any:
        """``value`` in the option's own type (a list becomes a tuple); ``ValueError`` naming the option."""
        if value is None:
            if self.nullable:
                return None
            raise ValueError(f"{self.name} must be {self.describe(limits)}, not null")
        lo, hi = self.bounds(limits)
        if self.kind is tuple:
            if not isinstance(value, (list, tuple)) or not value or len(value) > self.max_items:
                what = "integers" if self.item is int else "numbers"
                raise ValueError(f"{self.name}={value!r} must be a non-empty list of at most {self.max_items} "
                                 f"{what}, e.g. [{_fmt(lo if lo is not None else 0, '0')}]")
            return tuple(_number(f"{self.name}[]", item, self.item, lo, hi, self.multiple_of) for item in value)
        if self.kind is list:
            if not isinstance(value, (list, tuple)) or not value or len(value) > self.max_items \
                    or not all(isinstance(item, Mapping) for item in value):
                raise ValueError(f"{self.name} must be a non-empty list of at most {self.max_items} objects")
            return tuple(dict(item) for item in value)
        if self.kind is str:
            if not isinstance(value, str):
                raise ValueError(f"{self.name} must be a string, got {type(value).__name__}")
            return value
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{self.name}={value!r} must be true or false")
            return value
        return _number(self.name, value, self.kind, lo, hi, self.multiple_of)


def _fmt(x: float | str | None, missing: str) -> str:
    if x is None:
        return missing
    if isinstance(x, str):
        return x
    return str(int(x)) if float(x).is_integer() else str(x)


def _number(name: str, value: Any, kind: type, lo: float | None, hi: float | None, multiple_of: int | None):
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} must be an integer")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name}={value} is out of range; use a value in [{_fmt(lo, '-inf')}, {_fmt(hi, 'inf')}]")
    if multiple_of and value % multiple_of:
        nearest = max(multiple_of, int(value) // multiple_of * multiple_of)
        raise ValueError(f"{name}={value} is not a multiple of {multiple_of}; try {nearest}")
    return kind(value)


@dataclass(frozen=True)
class ModelOptions:
    """Every option one model's requests may set, in the order they are shown."""

    model: str
    """Whose options these are, for messages (the model's display name)."""
    options: tuple[Option, ...]
    takes_media: bool = True
    """Whether requests may carry conditioning media (``image``, ``conditions``)."""
    needs_image: bool = False
    """Whether every request must carry its first frame (``image``): an image-to-video model."""
    check: Callable[[Mapping[str, Any]], None] | None = field(default=None, compare=False)
    """A check across options of the resolved values (every declared name), run last by :meth:`resolve`; raises
    ``ValueError`` naming the options and the fix (e.g. a size that one of the model's modes cannot take)."""
    window_media: tuple[str, ...] = ("image", "extends")
    """What a request made window by window may carry besides its prompt: ``image`` (image-to-video), ``extends`` (an
    extension of a video), ``conditions`` (media the model's own check, ``check_media``, says how it takes)."""
    check_media: Callable[[Any], None] | None = field(default=None, compare=False)
    """A check of a resolved request's media (``image``, ``conditions``) that only the model can make (which media
    its pipeline takes, and how many frames), run by ``check_request`` after the checks every model shares; raises
    ``ValueError`` naming the field (``conditions[0].media``, ...) and the fix."""
    window_tile_causal: bool = False
    """How a window's length in frames counts in latent frames (``T``: the VAE's temporal compression): ``False``,
    ``frames // T`` (windows of ``T * k`` frames); ``True``, ``(frames - 1) // T + 1`` (windows of ``T * k + 1``
    frames, the first latent frame holding one). The playground counts a request's windows with it."""
    window_frames: Callable[[Mapping[str, Any]], int] | None = field(default=None, compare=False)
    """For a model that makes long videos window by window: the video frames of the longest sequence a request's
    plan denoises at once (the resolved values; the deployment's token limit applies to it). ``None``: the whole
    video is one sequence."""
    live_frames: Callable[[Mapping[str, Any], int], int] | None = field(default=None, compare=False)
    """For a model that can make a live video (``cp_infer.live``): ``(values, k)`` -> the video frames of a video of
    ``k`` whole windows (chunks) under the resolved values, whose plan's first passes are those of any shorter such
    video's. ``None``: the model makes no live video."""
    live_prompts: str = ""
    """With ``live_frames``: the declared option a live video's directions become, a prompt per range of windows
    (``[{"start_window", "end_window", "text"}]``), so that the live video is the one request with that option."""
    window_count: Callable[[Mapping[str, Any]], int] | None = field(default=None, compare=False)
    """For a model that makes long videos window by window: the resolved values -> how many windows (chunks) the
    video is made in (1: not windowed). ``None``: a request is windowed where ``window_frames`` is under its frames."""
    window_images: Callable[[Mapping[str, Any]], tuple[int, ...]] | None = field(default=None, compare=False)
    """For a model whose windows may each start from an image (``cp_infer.request.window_images``): the resolved
    values -> the video frame each window starts from, where a request's ``conditions`` place those images (a live
    video's directions' images go there). ``None``: only the first window takes an image (``image``)."""

    def __post_init__(self) -> None:
        names = [o.name for o in self.options] + [a for o in self.options for a in o.aliases]
        assert len(names) == len(set(names)), f"{self.model}: option names and aliases must be unique"
        missing = set(STANDARD) - {o.name for o in self.options}
        assert not missing, f"{self.model} must declare the standard options {sorted(missing)}"

    def __iter__(self):
        return iter(self.options)

    def __contains__(self, name: object) -> bool:
        return any(o.name == name for o in self.options)

    def __getitem__(self, name: str) -> Option:
        for option in self.options:
            if option.name == name:
                return option
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.options)

    @property
    def extra(self) -> tuple[Option, ...]:
        """The options that are the model's alone (not :data:`STANDARD`)."""
        return tuple(o for o in self.options if o.name not in STANDARD)

    def canonical_name(self, name: str) -> str | None:
        """The declared name for ``name`` (itself or an alias), or ``None`` when the model has no such option."""
        for option in self.options:
            if name == option.name or name in option.aliases:
                return option.name
        return None

    def canonical(self, values: Mapping[str, Any], *, known: Iterable[str] = ()) -> dict[str, Any]:
        """``values`` with aliases renamed to the declared names; keys in ``known`` (the caller's own fields) are
        kept as they are. An undeclared name, or an option given under two names, is a ``ValueError``."""
        known = set(known)
        out: dict[str, Any] = {}
        for key, value in values.items():
            if key in known:
                out[key] = value
                continue
            name = self.canonical_name(key)
            if name is None:
                raise UnknownOption(key, self)
            if name in out:
                raise ValueError(f"{name} was given twice (as {name} and its alias {key}); give it once")
            out[name] = value
        return out

    def resolve(self, values: Mapping[str, Any], *, limits: object | None = None,
                geometry: object | None = None) -> dict[str, Any]:
        """Every declared option's value: ``values`` (declared names or aliases, ``None`` meaning unset) checked,
        the defaults filled in. With ``limits``, a value given is checked against its option's limit where its
        feature is on (:attr:`Option.when`), and a default over a limit is lowered to what the limit allows
        (:meth:`Option.within_limit`, with the model's ``geometry`` where known)."""
        given = {name: value for name, value in self.canonical(values).items() if value is not None}
        out: dict[str, Any] = {}
        for option in self.options:
            # An option of a feature is checked against its limit once the feature's own option is resolved.
            out[option.name] = option.validate(given[option.name], None if option.when else limits) \
                if option.name in given else option.default
        for option in self.options:  # in declaration order: a default may follow the resolved values before it
            name = option.name
            if name in given:
                if option.when is not None and limits is not None and option.applies(out):
                    option.validate(out[name], limits)
                continue
            if option.default_for is not None:
                out[name] = option.default_for(out)
            out[name] = option.within_limit(out[name], out, limits, geometry)
        for option in self.options:
            value = out[option.name]
            if value is not None and option.check is not None:
                option.check(value)
            out[option.name] = tuple(value) if isinstance(value, list) else value
        if self.check is not None:
            self.check(out)
        return out


class UnknownOption(ValueError):
    """A name the loaded model declares no option for."""

    def __init__(self, name: str, options: ModelOptions):
        self.name = name
        super().__init__(f"{name} is not an option of {options.model} models: remove it "
                         f"(its options: {', '.join(options.names)})")
