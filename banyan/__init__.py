"""Banyan: LLM serving engine. ``import banyan as bn`` gives the frontend language
(``bn.function``, ``bn.gen``, ``bn.select``, ``bn.user`` …, ``bn.Backend``, ``bn.session``); it loads on
first use."""

_LANG = ("Backend", "ForkGroup", "Program", "ProgramState", "ServerError", "ServerUnreachable", "SessionState",
         "assistant", "function", "gen", "select", "session", "set_default_backend", "system", "user")


def __getattr__(name: str):
    if name in _LANG:
        from banyan import lang

        return getattr(lang, name)
    raise AttributeError(f"module 'banyan' has no attribute {name!r}")


__all__ = list(_LANG)
