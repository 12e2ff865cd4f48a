"""Command-line options generated from ``@dataclass`` configs: a setting lives in one place.

A config field gives its option: the name (``eval_batch_size`` -> ``--eval-batch-size``),
the parser (from the type), the default (shown in ``--help``) and the help text (the
field's trailing ``# comment``, or ``field(metadata={"help": ...})``). Use it like this::

    @dataclass
    class BuildConfig:
        out: str  # where the index goes            -> required --out OUT
        dims: list[int] = field(default_factory=list)  # top-m to index -> --dims 16,32
        factory: str = "auto"  # FAISS factory       -> --factory F (default: auto)
        add: bool = False  # append                  -> --add
        data_config: DataConfig = field(default_factory=DataConfig)  # flattened: --sep, --image-key, ...

    p = sub.add_parser("build", help="...")
    add_options(p, BuildConfig, aliases={"dims": ["--m"]}, choices={"factory": [...]})
    p.add_argument("--json", action="store_true")   # options that are not config fields: as usual
    ...
    cfg = to_config(BuildConfig, ns)        # the typed config, nested configs rebuilt
    given_fields(ns)                         # {"out", "dims", "data_config.sep"}: what was typed

Types: ``bool`` is a flag (default False: ``--name``; default True: ``--no-name``);
``bool | None`` with default None is a pair, ``--name`` / ``--no-name`` (None: not given, the
caller decides; ``off_aliases`` names the second flag otherwise, e.g. ``--unlock-image``);
``int`` / ``float`` / ``str`` and ``X | None`` parse as X (floats must be finite);
``list[int]`` / ``list[float]`` / ``list[str]`` take comma-separated values; ``Literal[...]``
or ``choices={field: values}`` (any iterable, e.g. :class:`LazyChoices` for names known
only after a heavy import) give choices; ``dict`` is a repeated ``--name K=V`` (a value
is JSON where it parses as JSON, else a string); a nested dataclass contributes its own
fields (no prefix unless ``prefix=`` is given). A field without a default is required.
``exclude`` leaves fields out (``to_config`` then uses their defaults). A field's metadata may
say more: ``positional`` (an argument without a flag), ``metavar``, ``flags`` (its option strings instead of
``--name``, e.g. ``["-k"]``), ``repeat`` (a ``list[str]`` that each use of the option adds one
item to, e.g. ``--text "a, b" --text c``). Bounds (``triclip.core.config.bounded``) are checked by
``triclip.core.config.check_fields`` on the config, not here.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import math
import textwrap
import tokenize
import typing
from typing import Any, Callable, Iterable, Iterator, Sequence

_GIVEN = "_options_given"  # Namespace attribute: the field paths typed on the command line


class LazyChoices(Sequence):
    """Choices computed on first use (e.g. a registry that needs a heavy import)."""

    def __init__(self, load: Callable[[], Iterable]):
        self._load, self._values = load, None

    def _all(self) -> list:
        if self._values is None:
            self._values = list(self._load())
        return self._values

    def __getitem__(self, i):
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator:
        return iter(self._all())

    def __contains__(self, value) -> bool:
        return value in self._all()


def add_options(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    prefix: str = "",
    aliases: dict[str, Sequence[str]] | None = None,
    choices: dict[str, Iterable] | None = None,
    exclude: Iterable[str] = (),
    required: Iterable[str] = (),
    off_aliases: dict[str, Sequence[str]] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Add one option per field of the dataclass ``cls`` (nested dataclasses flattened).

    Args:
        prefix: put before every flag and dest of this class's own fields (``"data-"``).
        aliases: field path -> extra option strings, e.g. ``{"weight_decay": ["--wd"]}``.
        choices: field path -> allowed values (overrides a ``Literal``).
        exclude: field paths not to offer.
        required: field paths to make required although they have a default.
        off_aliases: field path -> extra option strings that set a ``bool | None`` field to False.
        overrides: field path -> ``add_argument`` keyword arguments that replace the derived ones, e.g.
            ``{"train_data": {"required": False}}`` or a ``help`` worded for this command.
    """
    aliases, choices, exclude, required = aliases or {}, choices or {}, set(exclude), set(required)
    off_aliases, overrides = off_aliases or {}, overrides or {}
    for spec in _specs(cls, prefix):
        if spec.path in exclude:
            continue
        kwargs = {**_argument(spec, choices.get(spec.path), spec.path in required), **overrides.get(spec.path, {})}
        if spec.metadata.get("positional"):
            kwargs.pop("required", None)
            parser.add_argument(spec.dest, **kwargs)
            continue
        flags = list(spec.metadata.get("flags", [spec.flag]))
        if _strip_optional(spec.type) is bool and spec.default is True:
            flags = ["--no-" + flags[0][2:]]  # the flag turns the setting off
        parser.add_argument(*flags, *aliases.get(spec.path, ()), dest=spec.dest, **kwargs)
        if _strip_optional(spec.type) is bool and spec.default is None:  # tri-state: an explicit off switch
            off = {**kwargs, "const": False, "help": f"set {flags[0]} off"}
            off.pop("required", None)
            parser.add_argument("--no-" + flags[0][2:], *off_aliases.get(spec.path, ()), dest=spec.dest, **off)


def parse_config(cls: type, argv: Sequence[str] | None, description: str = "", **options):
    """``cls`` from a command line of its fields alone (a benchmark's ``main``): ``add_options(parser, cls,
    **options)``, parsed with abbreviations off; a ``ValueError`` of the config is an argparse error (exit 2)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=description)
    add_options(parser, cls, **options)
    try:
        return to_config(cls, parser.parse_args(argv))
    except ValueError as err:
        parser.error(str(err))


def to_config(cls: type, ns: argparse.Namespace, prefix: str = ""):
    """The Namespace's values as an instance of ``cls`` (fields not on the Namespace: defaults)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        hint = _hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = to_config(hint, ns, prefix)
            continue
        dest = (prefix + f.name).replace("-", "_")
        if hasattr(ns, dest):
            value = getattr(ns, dest)
            kwargs[f.name] = dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value
    return cls(**kwargs)


def given_fields(ns: argparse.Namespace) -> set[str]:
    """Field paths (``"lr"``, ``"data.sep"``) whose option was typed on the command line."""
    return set(getattr(ns, _GIVEN, ()))


def field_help(cls: type) -> dict[str, str]:
    """Field name -> help: ``metadata["help"]``, else the field's trailing ``# comment``."""
    comments = _comments(cls)
    return {f.name: f.metadata.get("help") or comments.get(f.name, "") for f in dataclasses.fields(cls)}


# ---------------------------------------------------------------------------- fields


@dataclasses.dataclass
class _Spec:
    path: str  # dotted field path from the top config: "data.sep"
    flag: str  # "--sep"
    dest: str  # Namespace attribute: "sep"
    type: Any  # the resolved annotation
    default: Any  # dataclasses.MISSING when required
    help: str
    metadata: Any = dataclasses.field(default_factory=dict)  # the field's metadata (positional, flags, repeat)


def _specs(cls: type, prefix: str, path: str = "") -> Iterator[_Spec]:
    helps = field_help(cls)
    for f in dataclasses.fields(cls):
        hint = _hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _specs(hint, prefix, f"{path}{f.name}.")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        name = prefix + f.name
        yield _Spec(path + f.name, "--" + name.replace("_", "-"), name.replace("-", "_"), hint, default, helps[f.name],
                    f.metadata)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _comments(cls: type) -> dict[str, str]:
    """The trailing ``# comment`` of each annotated field in the class body's source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (built at run time, frozen app)
        return {}
    by_line = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    body = ast.parse(source).body[0]
    return {
        node.target.id: by_line[node.end_lineno]
        for node in getattr(body, "body", [])
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.end_lineno in by_line
    }


# ---------------------------------------------------------------------------- argparse


def _argument(spec: _Spec, choices: Iterable | None, force_required: bool) -> dict:
    """``add_argument`` keyword arguments for one field."""
    base = _strip_optional(spec.type)
    origin = typing.get_origin(base)
    required = spec.default is dataclasses.MISSING or force_required
    kwargs: dict[str, Any] = {"path": spec.path, "default": None if spec.default is dataclasses.MISSING else spec.default}
    if base is bool:
        return {**kwargs, "action": _Store, "nargs": 0, "const": spec.default is not True, "help": _help(spec.help, None)}
    if base is dict or origin is dict:
        kwargs.update(action=_Pairs, metavar="K=V", help=_help(spec.help + " (repeat the option for several)", None))
    elif spec.metadata.get("repeat"):
        kwargs.update(action=_Append, help=_help(spec.help + " (repeat the option for several)", None))
    elif origin in (list, tuple):
        (item,) = typing.get_args(base)[:1] or (str,)
        kwargs.update(action=_Store, type=_comma_list(item), metavar=f"{item.__name__.upper()},...")
        kwargs["help"] = _help(spec.help, ",".join(map(str, spec.default)) if spec.default else None)
    else:
        if origin is typing.Literal:
            literal = typing.get_args(base)
            choices = literal if choices is None else choices
            base = type(literal[0])
        kwargs.update(action=_Store, type=_parser(base), help=_help(spec.help, spec.default))
        if choices is not None:
            kwargs["choices"] = choices
        if isinstance(choices, LazyChoices):  # argparse lists choices in the metavar eagerly: not these
            kwargs["metavar"] = spec.dest.upper()
            kwargs["help"] += " (one of: %(choices)s)"
    if "metavar" in spec.metadata:
        kwargs["metavar"] = spec.metadata["metavar"]
    if required:
        kwargs["required"] = True
    return kwargs


def _strip_optional(hint):
    """``X | None`` -> X."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, _union_type()) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


def _union_type():
    import types

    return types.UnionType


def _help(text: str, default) -> str:
    text = text.replace("%", "%%")  # argparse formats help with %
    if default is None or default is dataclasses.MISSING or default == "":
        return text
    return f"{text} (default: {default})" if text else f"(default: {default})"


def _parser(kind) -> Callable[[str], Any]:
    if kind is float:
        return _finite_float
    if kind in (int, str):
        return kind
    return str


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _comma_list(item) -> Callable[[str], list]:
    parse = _parser(item)
    names = {int: "integers", float: "numbers"}

    def parse_list(text: str) -> list:
        try:
            return [parse(x.strip()) for x in text.split(",") if x.strip()]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"expected comma-separated {names.get(item, 'values')}, got {text!r}") from None

    parse_list.__name__ = f"list of {item.__name__}"
    return parse_list


def parse_pair(text: str) -> tuple[str, Any]:
    """``"tau_plus=0.1"`` -> ``("tau_plus", 0.1)``; the value is JSON where it parses as JSON."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected K=V, got {text!r}")
    key, value = text.split("=", 1)
    if not key:
        raise argparse.ArgumentTypeError(f"expected K=V, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


class _Tracked(argparse.Action):
    """An action that also records which field it set (see :func:`given_fields`)."""

    def __init__(self, *args, path: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.path = path

    def _mark(self, ns: argparse.Namespace) -> None:
        given = getattr(ns, _GIVEN, None)
        if given is None:
            given = set()
            setattr(ns, _GIVEN, given)
        given.add(self.path)


class _Store(_Tracked):
    """``store`` (or, with ``nargs=0``, ``store_const``) that records the field."""

    def __call__(self, parser, ns, values, option_string=None):
        setattr(ns, self.dest, self.const if self.nargs == 0 else values)
        self._mark(ns)


class _Append(_Tracked):
    """Each use adds one item to a list (a fresh list: the default is never modified)."""

    def __call__(self, parser, ns, values, option_string=None):
        current = getattr(ns, self.dest, None)
        if _GIVEN not in vars(ns) or self.path not in getattr(ns, _GIVEN):
            current = []  # first use: the items typed replace the default
        setattr(ns, self.dest, [*current, values])
        self._mark(ns)


class _Pairs(_Tracked):
    """Repeated ``K=V`` into a dict (a fresh dict: the default is never modified)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("type", parse_pair)
        super().__init__(*args, **kwargs)

    def __call__(self, parser, ns, values, option_string=None):
        key, value = values
        current = getattr(ns, self.dest, None)
        if _GIVEN not in vars(ns) or self.path not in getattr(ns, _GIVEN):
            current = dict(current or {})  # first use: start from a copy of the default
        current[key] = value
        setattr(ns, self.dest, current)
        self._mark(ns)
