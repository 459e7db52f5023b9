"""The configured providers of one broker, looked up by name."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from broker.errors import BadRequest
from broker.providers.base import Provider
from broker.providers.simulated import SimulatedProvider
from broker.settings import Settings

DEFAULT_PROVIDER = "simulated"

log = logging.getLogger("broker.providers")


def _models(raw: str | None) -> tuple[str, ...]:
    return tuple(m.strip() for m in (raw or "").split(",") if m.strip())


class Providers:
    """The configured providers of one broker.

    ``simulated`` is always there; ``openai`` (any OpenAI-compatible Chat Completions server)
    and ``anthropic`` are there when ``BROKER_OPENAI_MODELS`` / ``BROKER_ANTHROPIC_MODELS``
    name their models.
    """

    def __init__(self, settings: Settings) -> None:
        self._providers: dict[str, Provider] = {
            "simulated": SimulatedProvider(max_tokens_per_s=settings.simulate_max_tokens_per_s),
        }
        if _models(settings.openai_models):
            from broker.providers.openai import OpenAIProvider

            self._providers["openai"] = OpenAIProvider(
                base_url=settings.openai_base_url,
                api_key=settings.openai_api_key,
                models=_models(settings.openai_models),
                continue_final_message=bool(settings.openai_continue_final_message),
            )
        if _models(settings.anthropic_models):
            from broker.providers.anthropic import AnthropicProvider

            self._providers["anthropic"] = AnthropicProvider(
                base_url=settings.anthropic_base_url,
                api_key=settings.anthropic_api_key,
                models=_models(settings.anthropic_models),
                max_tokens=settings.anthropic_max_tokens,
            )

    def __iter__(self) -> Iterator[Provider]:
        return iter(self._providers.values())

    async def aclose(self) -> None:
        """Close every provider (their HTTP clients); one failing does not keep the others open."""
        for provider in self._providers.values():
            try:
                await provider.aclose()
            except Exception:
                log.exception("closing provider %s failed", provider.name)

    @staticmethod
    def model_for(provider: Provider, model: str | None) -> str:
        """The model a turn runs on: the provider's default, or one it serves; 400 otherwise."""
        if model is None:
            return provider.models[0] if provider.models else ""
        if provider.models and model not in provider.models:
            raise BadRequest(
                f"unknown model {model!r} for provider {provider.name!r}; "
                f"configured: {', '.join(provider.models)}",
                code="unknown_model",
            )
        return model

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._providers)

    def get(self, name: str | None) -> Provider:
        """The provider called ``name`` (the default when None); 400 when unknown."""
        key = name or DEFAULT_PROVIDER
        try:
            return self._providers[key]
        except KeyError:
            raise BadRequest(
                f"unknown provider {key!r}; configured: {', '.join(self._providers)}",
                code="unknown_provider",
            ) from None
