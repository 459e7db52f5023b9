"""The configured providers of one broker, looked up by name."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from broker.errors import BadRequest
from broker.providers.base import Provider
from broker.providers.simulated import SimulatedProvider
from broker.settings import PROVIDER_NAMES, Settings

log = logging.getLogger("broker.providers")


def _models(raw: str | None) -> tuple[str, ...]:
    return tuple(m.strip() for m in (raw or "").split(",") if m.strip())


class Providers:
    """The providers one broker serves (:attr:`Settings.served_providers`), the first the
    default: ``simulated``, ``openai`` (any OpenAI-compatible Chat Completions server) and
    ``anthropic``, each of the last two with the models ``BROKER_OPENAI_MODELS`` /
    ``BROKER_ANTHROPIC_MODELS`` name.
    """

    def __init__(self, settings: Settings) -> None:
        # In the order served: the first is the default.
        self._providers: dict[str, Provider] = {
            name: self._build(name, settings) for name in settings.served_providers
        }

    @staticmethod
    def _build(name: str, settings: Settings) -> Provider:
        if name == "simulated":
            return SimulatedProvider(
                max_tokens_per_s=settings.simulate_max_tokens_per_s,
                scripting=settings.simulate_scripting_on,
            )
        if name == "openai":
            from broker.providers.openai import OpenAIProvider

            return OpenAIProvider(
                base_url=settings.openai_base_url,
                api_key=settings.openai_api_key,
                models=_models(settings.openai_models),
                continue_final_message=bool(settings.openai_continue_final_message),
            )
        from broker.providers.anthropic import AnthropicProvider

        return AnthropicProvider(
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
        """The providers served, the first the default."""
        return tuple(self._providers)

    @property
    def known(self) -> tuple[str, ...]:
        """Every provider name a broker may serve, served here or not."""
        return PROVIDER_NAMES

    def get(self, name: str | None) -> Provider:
        """The provider called ``name`` (the default when None); 400 when it is not served."""
        key = name or next(iter(self._providers))
        try:
            return self._providers[key]
        except KeyError:
            served = ", ".join(self._providers)
            if key in PROVIDER_NAMES:
                raise BadRequest(
                    f"provider {key!r} is not served by this broker (BROKER_PROVIDERS); "
                    f"served: {served}",
                    code="provider_not_served",
                ) from None
            raise BadRequest(
                f"unknown provider {key[:64]!r}; served: {served}", code="unknown_provider"
            ) from None
