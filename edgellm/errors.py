"""The exceptions edgellm raises. Every failure a user can cause maps to one of these, with a readable message."""


class EdgeLLMError(Exception):
    """Base class of every error edgellm raises on purpose."""


class GGUFError(EdgeLLMError, ValueError):
    """A GGUF file is malformed, truncated or uses something this reader does not support."""


class ModelError(EdgeLLMError, ValueError):
    """A model cannot be built: unknown architecture, missing or mis-shaped tensor, bad config value."""


class TokenizerError(EdgeLLMError, ValueError):
    """The tokenizer metadata is unusable, or a token id is out of range."""


class SamplingError(EdgeLLMError, ValueError):
    """A sampling parameter is out of range, or the logits are not finite."""


class GrammarError(SamplingError):
    """A JSON Schema, grammar, regex or choice list is invalid or uses what the constraint engine cannot enforce;
    raised before any token is generated. A SamplingError because it constrains what can be sampled."""


class CatalogError(EdgeLLMError, LookupError):
    """A model name is not in the catalog, or fetching it failed."""


class MemoryBudgetError(EdgeLLMError, MemoryError):
    """What was asked for does not fit in the memory available; the message gives both figures."""


class DeviceError(EdgeLLMError, RuntimeError):
    """The requested device (e.g. CUDA) is not usable on this machine."""


class PromptError(ModelError):
    """The prompt is empty, of the wrong type, or does not fit in the context."""


class ModelBusyError(EdgeLLMError, RuntimeError):
    """A second generation was started on a model while another (e.g. an unfinished stream) still runs."""


class ServerClosing(EdgeLLMError, RuntimeError):
    """The server's scheduler is stopping (or stopped): every request still queued or running ends with this."""


class NumericalError(SamplingError):
    """The model's logits hold NaN or Inf (a corrupt file with huge but finite-looking scales, or an overflow);
    reported instead of sampled. A SamplingError because sampling is where such logits were first refused."""


class Cancelled(EdgeLLMError):
    """Model.cancel() ended a call that has no partial result to give (logits()); generating calls instead return
    what they have, with stop_reason "cancelled"."""
