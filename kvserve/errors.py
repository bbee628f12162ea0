"""Error types shared by all parts; each maps to a client-facing status later."""


class KVServeError(Exception):
    """Base class for kvserve errors."""


class ModelLoadError(KVServeError):
    """A model file or directory is missing, corrupt or unsupported.

    The message always names the file and what is wrong with it.
    """


class InvalidRequestError(KVServeError, ValueError):
    """A request's parameters or prompt are invalid (maps to HTTP 400 / INVALID_ARGUMENT)."""


class OutOfKVCacheError(KVServeError):
    """A request alone needs more KV blocks than the whole device pool holds."""


class StartupError(KVServeError):
    """The served application did not start; the message names the part that failed and why."""


class EngineDeadError(KVServeError):
    """The engine cannot step any more: a rank of a tensor-parallel engine died or its group
    failed. The message names the rank; the worker that holds the engine must be restarted."""


class ConfigError(KVServeError, ValueError):
    """A setting that cannot be honoured as given (invalid, or a file it names cannot be
    used); the message names it and the ways out."""


class AdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be loaded: files missing or corrupt, a rank above the
    limit, a module kvserve does not adapt, or shapes of another base model (HTTP 400 /
    INVALID_ARGUMENT). The message names the adapter and what is wrong; nothing was loaded."""


class NotFoundError(KVServeError):
    """A request names a model or LoRA adapter that is not served here (HTTP 404 /
    NOT_FOUND); the message names it."""
