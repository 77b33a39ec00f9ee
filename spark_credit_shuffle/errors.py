"""Typed errors. Every error names what was wrong and what would be accepted instead."""

from __future__ import annotations

import contextlib
import difflib
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any


class CreditShuffleError(Exception):
    """Base class of every error this package raises on purpose."""


#: The names of the settings (NetworkConfig's fields), which :class:`ConfigError` calls settings; any other name
#: it calls an argument.
_SETTINGS: set[str] = set()


def register_settings(names: Iterable[str]) -> None:
    """Make ``names`` the names :class:`ConfigError` calls settings (NetworkConfig registers its fields)."""
    _SETTINGS.update(names)


#: ``ConfigError.replaced``'s default: keep the value.
_KEEP: Any = object()


class ConfigError(CreditShuffleError, ValueError):
    """An invalid setting or argument, raised before any Spark job starts.

    ``setting`` is the option or argument name (as a keyword argument or ``spark.creditShuffle.*`` key),
    ``value`` the rejected value and ``allowed`` a human description of what is accepted. ``conf_key``, when
    the value came from a Spark conf, is the key the user set: the message names it beside the setting.
    ``kind`` is what the name is, for the message: ``"setting"`` (a NetworkConfig setting) or ``"argument"``
    (a function's argument, such as ``exchange``'s ``df`` or ``mode``), so that nobody looks for an argument
    among the settings; by default a setting's name (:func:`register_settings`) or a value from a conf is a
    setting and any other name an argument. ``choices``, for a name that takes one of a few words (a mode, a
    codec), are those words: a string value close to one of them adds "did you mean ...?" to the message (and
    ``nearest``).
    """

    def __init__(
        self,
        setting: str,
        value: object,
        allowed: str,
        detail: str = "",
        *,
        conf_key: str | None = None,
        kind: str | None = None,
        choices: Iterable[str] | None = None,
    ) -> None:
        self.setting = setting
        self.value = value
        self.allowed = allowed
        self.detail = detail
        self.conf_key = conf_key
        if kind is None:
            kind = "setting" if conf_key is not None or setting in _SETTINGS else "argument"
        self.kind = kind
        self.choices: tuple[str, ...] | None = tuple(choices) if choices is not None else None
        self.nearest: str | None = suggest(value, self.choices) if self.choices else None
        named = f"'{setting}' ({conf_key})" if conf_key else f"'{setting}'"
        message = f"invalid value {value!r} for {kind} {named}: allowed is {allowed}"
        if detail:
            message += f" ({detail})"
        if self.nearest is not None:
            message += f"; did you mean {self.nearest!r}?"
        super().__init__(message)

    def replaced(self, *, value: object = _KEEP, conf_key: str | None = None) -> ConfigError:
        """The same error with the value as the user wrote it and/or the conf key it came from (the message
        names what the user typed, not what it was parsed into); kind and choices are kept."""
        return ConfigError(
            self.setting,
            self.value if value is _KEEP else value,
            self.allowed,
            self.detail,
            conf_key=conf_key if conf_key is not None else self.conf_key,
            kind=self.kind,
            choices=self.choices,
        )


def suggest(value: object, choices: Iterable[str] | None) -> str | None:
    """The one of ``choices`` that ``value`` (a string) most likely misspells, case and surrounding blanks
    ignored (a choice in another case is the one meant); None if ``value`` is not a string, is one of them
    exactly, or is close to none (difflib's ratio below 0.6)."""
    if not isinstance(value, str) or not choices:
        return None
    known = {c.lower(): c for c in choices}
    text = value.strip().lower()
    if text in known:  # a choice in another case or with blanks, where the exact word is needed
        return None if value == known[text] else known[text]
    if not text:
        return None
    match = difflib.get_close_matches(text, list(known), n=1, cutoff=0.6)
    return known[match[0]] if match else None


class UnknownSettingError(ConfigError):
    """A ``spark.creditShuffle.*`` key or keyword argument that names no setting (a key under the prefix in
    another case, ``spark.creditshuffle.*``, included): the message names the nearest setting, or lists
    them all when none is near."""

    def __init__(self, setting: str, known: Iterable[str]) -> None:
        known_list = sorted(known)
        nearest = _nearest(setting, known_list)
        super().__init__(setting, "<unknown setting>", f"one of: {', '.join(known_list)}")
        self.nearest = nearest
        if self.nearest is not None:
            message = f"unknown setting '{setting}'; did you mean '{self.nearest}'?"
        else:
            message = f"unknown setting '{setting}'; the settings are: {', '.join(known_list)}"
        self.args = (message,)


def _nearest(name: str, known: list[str]) -> str | None:
    """The one of ``known`` that ``name`` most likely misspells, by the part after the last dot (a key's
    ``spark.creditShuffle.`` prefix does not count towards the likeness), case ignored; None if none is close."""
    tails = {k.lower().rsplit(".", 1)[-1]: k for k in known}
    match = difflib.get_close_matches(name.lower().rsplit(".", 1)[-1], list(tails), n=1, cutoff=0.7)
    return tails[match[0]] if match else None


class PartitionerError(CreditShuffleError, ValueError):
    """A partitioner that cannot serve the requested exchange (Flink's UnsupportedOperationException)."""


class NullKeyError(PartitionerError):
    """A null key reached ``key_by``; Flink refuses these ("Assigned key must not be null!")."""


class UnsupportedKeyTypeError(PartitionerError, TypeError):
    """A key column whose type has no stable Java ``hashCode`` to reproduce."""


class UnsupportedColumnTypeError(CreditShuffleError, TypeError):
    """A column of a Spark type that Spark's Arrow hand-over to Python (``mapInArrow``) does not carry, so no
    exchange can move it (year-month and calendar intervals); raised before any Spark job starts."""


class SchemaMismatchError(CreditShuffleError, TypeError):
    """Rows whose column types differ from the schema the exchange was planned with (beyond nullability and
    a timestamp's zone, which the exchange reconciles)."""


class ChainedOperatorError(CreditShuffleError, TypeError):
    """A function chained into an exchange's tasks (``map_in_pandas`` / ``map_in_arrow``) yielded something
    other than its declared schema: the message names the operator and the column."""


class InsufficientNetworkBuffersError(CreditShuffleError):
    """The buffer pools asked for more network buffers than the executor's network memory holds."""

    def __init__(
        self, required: int, available: int, total: int, segment_size: int, setting: str, detail: str = ""
    ) -> None:
        self.required = required
        self.available = available
        self.total = total
        self.segment_size = segment_size
        self.setting = setting
        self.detail = detail
        super().__init__(
            f"Insufficient number of network buffers: required {required}, but only {available} available. "
            f"The total number of network buffers is currently set to {total} of {segment_size} bytes each. "
            f"You can increase this number by raising '{setting}'." + (f" ({detail})" if detail else "")
        )


class BufferDecodeError(CreditShuffleError):
    """A network buffer that does not decode: bad header, truncated payload, fragments out of order,
    or a schema other than the channel's."""

    def __init__(self, message: str, channel: int | None = None, sequence_number: int | None = None) -> None:
        self.channel = channel
        self.sequence_number = sequence_number
        where = f"channel {channel}, sequence number {sequence_number}: "
        super().__init__(where + message)


class ProtocolError(CreditShuffleError):
    """A violation of the network protocol: bad frame from the wire, or a message out of turn."""


class ExchangeTimeoutError(CreditShuffleError, TimeoutError):
    """A wait that ran out of time; the message names what was waited for."""


class UnsupportedInputError(CreditShuffleError, TypeError):
    """An input DataFrame that an exchange cannot take as it is (a streaming DataFrame: exchange each
    micro-batch in ``foreachBatch``); the message names the way that works."""


class BarrierStageError(CreditShuffleError):
    """A pipelined exchange that Spark would refuse to run as one barrier stage on this session (dynamic
    allocation, too few task slots); the message names the ways out."""


class WorkerPythonError(ConfigError):
    """The Python interpreter Spark would start the session's Python workers with on this machine cannot run
    the exchange's tasks (it lacks pyarrow or this package, it is missing, or it runs another Python version):
    raised on the driver before any job, instead of one failed task after another. ``setting`` is
    ``PYSPARK_PYTHON``, ``value`` the interpreter as Spark names it (``python3`` when nothing is set),
    ``python`` the file it resolves to (None if none) and ``problem`` what it lacks."""

    def __init__(self, value: str, python: str | None, problem: str, chosen_by: str, fix: str) -> None:
        super().__init__(
            "PYSPARK_PYTHON", value, f"an interpreter that imports pyarrow and spark_credit_shuffle: {fix}"
        )
        self.python = python
        self.problem = problem
        where = python if python is not None else value
        self.args = (
            f"Spark's Python workers would start {where} ({chosen_by}), which {problem}, so every task of the "
            f"exchange would fail. Set PYSPARK_PYTHON to an interpreter that imports pyarrow and "
            f"spark_credit_shuffle, such as this one, before the session starts: {fix}",
        )


class InsufficientSlotsError(BarrierStageError):
    """A pipelined exchange needs all its tasks running at once and the cluster has fewer free slots."""


class NetworkBuffersNotFreeError(CreditShuffleError):
    """Exclusive buffers that fit the network memory but are still held by other pools: retry once they
    are recycled (a runtime waits up to ``buffers_request_timeout_ms`` for this)."""

    def __init__(self, requested: int, free: int) -> None:
        self.requested = requested
        self.free = free
        super().__init__(
            f"{requested} exclusive network buffers requested, only {free} are free right now; the rest are "
            f"still held by other buffer pools and return as they are recycled"
        )


class PartitionNotFoundError(CreditShuffleError):
    """A partition request named a result partition the producer has not registered."""

    def __init__(self, partition_id: int, subpartition: int | None = None) -> None:
        self.partition_id = partition_id
        self.subpartition = subpartition
        where = f" (subpartition {subpartition})" if subpartition is not None else ""
        super().__init__(f"PartitionNotFound: result partition {partition_id}{where} is not registered")


class BufferReorderingError(ProtocolError):
    """A channel received a buffer whose sequence number is not the next one expected."""

    def __init__(self, expected: int, received: int, channel: int | None = None) -> None:
        self.expected = expected
        self.received = received
        self.channel = channel
        where = f"channel {channel}: " if channel is not None else ""
        super().__init__(
            f"{where}Buffer re-ordering: expected buffer with sequence number {expected}, but received {received}"
        )


class SimulationStalledError(CreditShuffleError):
    """A virtual-clock simulation stopped making progress (deadlock) or exceeded its step budget."""


class PartitionStateError(CreditShuffleError, RuntimeError):
    """An operation a result partition or subpartition does not allow in its current state (for example
    writing after ``finish()``, or a second reader of a pipelined subpartition)."""


class NoBufferAvailableError(CreditShuffleError):
    """A network buffer was requested from a LocalBufferPool that can give none now: its size plus the
    overdraft is in use, or every network buffer of the executor is taken. Flink's non-blocking
    ``requestBufferBuilder`` returns null here and ``requestBufferBuilderBlocking`` waits; the sans-IO core
    never hands out memory beyond these bounds, so a caller that cannot wait gets this error (a resumable
    ``RecordWriter`` stops instead and writes on with ``resume()`` once buffers were recycled)."""

    def __init__(self, subpartition: int, pool_size: int, overdraft: int, used: int, network_total: int) -> None:
        self.subpartition = subpartition
        self.pool_size = pool_size
        self.overdraft = overdraft
        self.used = used
        self.network_total = network_total
        super().__init__(
            f"no network buffer for subpartition {subpartition}: the buffer pool holds {used} segments "
            f"(size {pool_size} + overdraft {overdraft}; the executor has {network_total} network buffers); "
            "wait until buffers are recycled (a resumable RecordWriter stops here and resume() writes on)"
        )


# -- typed errors raised inside Spark tasks ----------------------------------------------------------------

#: ``spark_credit_shuffle.<module>.<Class>: <message>``, as a Python traceback prints an exception, up to a
#: blank line or the JVM's stack (``\tat ...``) that follows it in Spark's report of a failed task.
_RAISED = re.compile(r"\b(spark_credit_shuffle(?:\.\w+)*)\.(\w+): (.*?)(?=\n\s*\n|\n\tat |\n\s+at |\Z)", re.S)


#: The SQL state Spark appends to an error's message.
_SQL_STATE = re.compile(r"\s*SQLSTATE: \w+\s*$")


def _error_classes() -> dict[str, type[CreditShuffleError]]:
    """Every subclass of :class:`CreditShuffleError` defined so far, by ``module.name``."""
    found: dict[str, type[CreditShuffleError]] = {}
    pending: list[type[CreditShuffleError]] = [CreditShuffleError]
    while pending:
        cls = pending.pop()
        found[f"{cls.__module__}.{cls.__name__}"] = cls
        pending.extend(cls.__subclasses__())
    return found


def qualified_name(exc: BaseException) -> str:
    """``module.Class`` of ``exc``, as a Python traceback names it."""
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def rebuild(name: str, message: str) -> CreditShuffleError | None:
    """The error of this package's class ``name`` (``module.Class`` as :func:`qualified_name` gives, or a
    class of :mod:`errors` by its bare name) with ``message``, made without its constructor (whose
    arguments the text no longer has); None if ``name`` is no such class."""
    classes = _error_classes()
    cls = classes.get(name) or classes.get(f"{__name__}.{name}")
    if cls is None:
        return None
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


def task_error(exc: BaseException) -> CreditShuffleError | None:
    """The typed error an exchange's Spark task raised, rebuilt from ``exc``, the exception an action on the
    driver got (PySpark's ``PythonException`` or ``Py4JJavaError`` on a classic session, Connect's
    ``PythonException``: they carry the task's Python traceback, or the reason the exchange cancelled its
    stage with, as text); None if ``exc`` carries none.

    The rebuilt error is of the class the task raised and has its message; what the task's error held besides
    its message (``ConfigError.setting``, ...) is not carried. When several tasks failed, Spark reports the
    one that failed the stage first, which is the one returned.
    """
    if isinstance(exc, CreditShuffleError):
        return exc
    return error_in_text(str(exc))


#: What Python prints between an exception and the one raised from it or while handling it: the first is a cause.
_CHAINED = (
    "The above exception was the direct cause of the following exception",
    "During handling of the above exception, another exception occurred",
)


def error_in_text(text: str) -> CreditShuffleError | None:
    """The first of this package's errors that ``text`` names as a traceback prints one
    (``spark_credit_shuffle.errors.NullKeyError: message``), rebuilt; None if it names none.

    A chained traceback prints the causes before the exception raised (a consumer raises its producer's failure
    ``from`` its own channel error): an error followed by Python's chaining words is passed over for the one
    raised, and taken only if no error of this package follows it."""
    matches = list(_RAISED.finditer(text))
    causes: list[CreditShuffleError] = []
    for i, match in enumerate(matches):
        message = _SQL_STATE.sub("", match.group(3).strip())
        error = rebuild(f"{match.group(1)}.{match.group(2)}", message)
        if error is None:
            continue
        after = text[match.end() : matches[i + 1].start() if i + 1 < len(matches) else len(text)]
        if any(words in after for words in _CHAINED):
            causes.append(error)
            continue
        return error
    return causes[0] if causes else None


@contextlib.contextmanager
def typed_errors() -> Iterator[None]:
    """Raise, from a Spark action in the block, the typed error the exchange's task raised (a null key's
    :class:`NullKeyError`, a stall's :class:`ExchangeTimeoutError`, ...), with Spark's exception as its
    cause, so that ``except NullKeyError`` works around ``ex.df.count()``; any other error as it is::

        with scs.typed_errors():
            ex.df.write.parquet(path)
    """
    try:
        yield
    except CreditShuffleError:
        raise
    except Exception as exc:
        typed = task_error(exc)
        if typed is None:
            raise
        raise typed from exc


def _typed_line(exc: BaseException) -> str | None:
    """``module.Class: message`` of the typed error a Spark exception carries from an exchange's task; None
    for an exception of this package (its own traceback names it already) or one that carries none."""
    if isinstance(exc, CreditShuffleError) or not isinstance(exc, Exception):
        return None
    try:
        typed = task_error(exc)
    except Exception:  # whatever the text holds, reporting the exception must not fail on it
        return None
    return None if typed is None else f"{qualified_name(typed)}: {typed}"


def _header(line: str, spark_error: type[BaseException]) -> str:
    return (
        f"{line}\n(raised in a Spark task of the exchange; Spark's {spark_error.__name__} follows. "
        "`with spark_credit_shuffle.typed_errors():` raises the typed error itself)\n\n"
    )


ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]
#: What :func:`install_error_hook` replaced: ``sys.excepthook``'s hook, and IPython's custom handler and the
#: exceptions it claimed; empty when no hook is installed.
_INSTALLED: dict[str, Any] = {}


def _excepthook(etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    previous: ExceptHook = _INSTALLED.get("excepthook") or sys.__excepthook__
    line = _typed_line(value)
    if line is None:
        previous(etype, value, tb)
        return
    sys.stderr.write(_header(line, etype))
    sys.stderr.flush()
    previous(etype, value, tb)
    sys.stderr.write(f"\n{line}\n")
    sys.stderr.flush()


def _ipython_handler(
    shell: Any, etype: type[BaseException], value: BaseException, tb: TracebackType | None, tb_offset: Any = None
) -> None:
    line = _typed_line(value)
    if line is not None:
        sys.stderr.write(_header(line, etype))
        sys.stderr.flush()  # before the traceback, which a kernel sends as a message of its own
    claimed, handler = _INSTALLED.get("ipython", ((), None))
    if handler is not None and claimed and issubclass(etype, claimed):
        handler(etype, value, tb, tb_offset=tb_offset)  # the custom handler installed before this one
    else:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
    if line is not None:
        sys.stderr.write(f"\n{line}\n")
        sys.stderr.flush()


def install_error_hook() -> None:
    """Report an uncaught exception of a Spark action with the typed error of the exchange's task first.

    An error inside an exchange's task reaches the driver as Spark's exception (``Py4JJavaError: An error
    occurred while calling o130.count.``, ``PythonException``), its Java stack first, the task's typed error
    somewhere inside. Opt-in, as it changes how the process reports every uncaught exception: after this call
    one that carries a typed error (:func:`task_error`) is printed after ``module.Class: message`` of that
    error (``spark_credit_shuffle.errors.NullKeyError: producer subtask 1: key column 'k' has 1 null
    value(s) ...``), with that line again after Spark's traceback; any other exception as before. In a script
    the hook is ``sys.excepthook`` (wrapping the one there); in IPython and Jupyter, where ``sys.excepthook``
    does not run, also IPython's custom exception handler (``InteractiveShell.set_custom_exc``, wrapping a
    handler installed before). Calling it again changes nothing; :func:`uninstall_error_hook` puts back what
    was there. Code that catches the error itself uses :func:`typed_errors` instead."""
    if not _INSTALLED:
        _INSTALLED["excepthook"] = sys.excepthook
        sys.excepthook = _excepthook
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None and "shell" not in _INSTALLED:
        _INSTALLED["shell"] = shell
        _INSTALLED["ipython"] = (shell.custom_exceptions, shell.CustomTB if shell.custom_exceptions else None)
        shell.set_custom_exc((Exception,), _ipython_handler)
    _INSTALLED.setdefault("installed", True)


def uninstall_error_hook() -> None:
    """Undo :func:`install_error_hook`: the excepthook and IPython's custom handler that were there before."""
    if not _INSTALLED:
        return
    if sys.excepthook is _excepthook:
        sys.excepthook = _INSTALLED["excepthook"]
    shell = _INSTALLED.get("shell")
    if shell is not None:
        claimed, handler = _INSTALLED["ipython"]
        if handler is None:
            shell.set_custom_exc((), None)
        else:
            shell.CustomTB, shell.custom_exceptions = handler, claimed
    _INSTALLED.clear()


def is_deterministic(exc: BaseException) -> bool:
    """True for a failure that the same input raises again on every attempt: a null key, a key that cannot be
    hashed, a custom partitioner's function that raised or returned bad channels (:class:`PartitionerError`),
    a network buffer of the exchange's own data that does not decode (:class:`BufferDecodeError`). Retrying
    such a task or stage only repeats the failure; a runtime fails the exchange at once instead. A chained
    operator's output that does not fit its declared schema (:class:`ChainedOperatorError`) is one too."""
    return isinstance(exc, (PartitionerError, BufferDecodeError, ChainedOperatorError))


def in_subtask(exc: BaseException, side: str, subtask: int) -> BaseException:
    """A :class:`PartitionerError` with the subtask that met it in its message (the same class, so a user
    catches what the partitioner raises); any other exception as it is."""
    if not isinstance(exc, PartitionerError) or str(exc).startswith(f"{side} subtask "):
        return exc
    try:
        located = type(exc)(f"{side} subtask {subtask}: {exc}")
    except TypeError:  # a subclass with another constructor
        return exc
    return located.with_traceback(exc.__traceback__)
