"""Every Redis key name the broker uses, built in one place.

Every key lives in a slot chosen on purpose, so that the broker runs unchanged on Redis Cluster
and no key is global by accident:

* a conversation's keys (turns, leases, events, tombstones, the tool ledger, viewers) carry the
  hash tag ``{c:<conversation_id>}``, so every Lua script touches a single slot; so does the
  conversation's stop channel on a cluster (``<prefix>:{c:<conversation_id>}:stop``, sharded
  Pub/Sub);
* a tenant's keys (its rate bucket, its live streams) carry ``{t:<tenant>}``, and a session's
  retry budget ``{s:<session>}``;
* the job queue is ``job_partitions`` streams, ``<prefix>:{jobs:<i>}``, each in a slot of its own
  (with its doorbell channel ``<prefix>:{jobs:<i>}:bell`` on a cluster); a conversation's jobs
  all go to one partition (:func:`job_partition`); the completion webhooks' queue is the same
  shape, ``<prefix>:{webhooks:<i>}``, with each notification's delivery state beside its job
  (``<prefix>:{webhooks:<i>}:try:<job id>``, ``...:hold:<job id>``, and ``...:sent:<attempt>``
  once delivered);
* the two index keys map ids a client holds (turn id, stream id) to their conversation; they live
  in their own slots and are only read and written with single-key commands;
* a tenant's Durable Streams streams (each its metadata, data, producers and forks) and their
  accounting (the tenant's live streams, their sizes, its bytes and append rate) all carry the
  tenant's ``{ds:t:<tenant>}`` (an open broker's: ``{ds:open}``), so that one script creates,
  forks, appends and charges the tenant's quota in one slot; a stream is named within it by a
  digest of its path (paths may hold any character, braces and ``/`` included: no path can
  name another tenant's stream, nor an open broker's a tenant's);
* on a single server, stop notifications go on one classic Pub/Sub channel, ``<prefix>:stops``
  (a channel, not a key).
"""

from __future__ import annotations

import zlib

from broker.vocabulary import OPEN_TENANT

JOB_GROUP = "workers"


def job_partition(conversation_id: str, partitions: int) -> int:
    """The job partition of a (scoped) conversation: the same in every process, so every job of
    one turn, and of one conversation, goes to one stream and keeps its order."""
    return zlib.crc32(conversation_id.encode()) % partitions


class Keys:
    """Key builder for one key prefix (``BROKER_KEY_PREFIX``)."""

    __slots__ = ("prefix", "stop_channel")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        # A single server's one classic Pub/Sub channel for every stop notification.
        self.stop_channel = f"{prefix}:stops"

    def job_stream(self, partition: int, queue: str = "jobs") -> str:
        """Redis Stream: one partition of a job queue (``jobs``, generations; ``webhooks``,
        completion notifications), read by the workers' consumer group."""
        return f"{self.prefix}:{{{queue}:{partition}}}"

    def job_bell(self, partition: int, queue: str = "jobs") -> str:
        """Sharded Pub/Sub channel (a cluster's): rung when a job lands on the partition."""
        return f"{self.job_stream(partition, queue)}:bell"

    def webhook_try(self, stream: str, job_id: str) -> str:
        """Hash: one notification's delivery (tries, its body, its URL), in the slot of the
        webhook partition ``stream`` that holds its job."""
        return f"{stream}:try:{job_id}"

    def webhook_sent(
        self,
        stream: str,
        conversation_id: str,
        turn_id: str,
        attempt: int,
        approval_id: str | None = None,
    ) -> str:
        """String with a PEXPIRE: the attempt's (or approval request's) notification was
        delivered (a second job of it is settled unsent); in the slot of its webhook partition."""
        if approval_id is not None:
            return f"{stream}:sent:{conversation_id} {turn_id} {approval_id}"
        return f"{stream}:sent:{conversation_id} {turn_id} {attempt}"

    def webhook_hold(self, stream: str, job_id: str) -> str:
        """String with a PEXPIRE: no worker sends the notification before it expires (a try in
        flight, or the backoff after a failed one)."""
        return f"{stream}:hold:{job_id}"

    def stops(self, conversation_id: str) -> str:
        """Sharded Pub/Sub channel (a cluster's): stop notifications of the conversation's turns."""
        return f"{self.tag(conversation_id)}:stop"

    def tag(self, conversation_id: str) -> str:
        return f"{self.prefix}:{{c:{conversation_id}}}"

    def turn(self, conversation_id: str, turn_id: str) -> str:
        """Hash: the turn's request, status, attempts, canonical attempt and fence counter."""
        return f"{self.tag(conversation_id)}:turn:{turn_id}"

    def lease(self, conversation_id: str, turn_id: str) -> str:
        """Hash with a PEXPIRE: the fencing token and owner of the worker writing the turn."""
        return f"{self.tag(conversation_id)}:lease:{turn_id}"

    def events(self, conversation_id: str, turn_id: str) -> str:
        """Redis Stream: the turn's events; entry ids are the wire offsets."""
        return f"{self.tag(conversation_id)}:events:{turn_id}"

    def responses_seq(self, conversation_id: str, turn_id: str) -> str:
        """Sorted set, a cache expiring with the stream: checkpoints of the OpenAI Responses
        numbering of the turn's events (entry id, scored by the sequence number that follows
        it), left by ``seek_sequence.lua``."""
        return f"{self.events(conversation_id, turn_id)}:responses-seq"

    def tombstone(self, conversation_id: str, turn_id: str) -> str:
        """String: marks a finished turn, outliving its data, so its id cannot start a new turn."""
        return f"{self.tag(conversation_id)}:tombstone:{turn_id}"

    def rescue(self, conversation_id: str, turn_id: str) -> str:
        """String with a PEXPIRE: rate-limits re-queueing a turn that was never queued."""
        return f"{self.tag(conversation_id)}:rescue:{turn_id}"

    def tool_slot(self, conversation_id: str, turn_id: str, tool: str, ordinal: int) -> str:
        """Hash: one tool-call slot of the ledger (state, token, lease, result or error)."""
        return f"{self.tag(conversation_id)}:tool:{turn_id}:{tool}:{ordinal}"

    def tool_slots(self, conversation_id: str, turn_id: str) -> str:
        """Set: the ledger slots of a turn, for the audit."""
        return f"{self.tag(conversation_id)}:tools:{turn_id}"

    def tool_abandoned(self, conversation_id: str, turn_id: str) -> str:
        """List: tool calls cut off while their arguments were arriving (never run)."""
        return f"{self.tag(conversation_id)}:tools-abandoned:{turn_id}"

    def approval(self, conversation_id: str, turn_id: str, approval_id: str) -> str:
        """Hash: one approval request (its slot, request, expiry; once decided, the decision)."""
        return f"{self.tag(conversation_id)}:approval:{turn_id}:{approval_id}"

    def approvals_waiting(self, conversation_id: str, turn_id: str) -> str:
        """Set: the approval ids a parked attempt of the turn waits for."""
        return f"{self.tag(conversation_id)}:approvals-waiting:{turn_id}"

    def approval_expiry(self) -> str:
        """Sorted set: pending approvals (``<conversation> <turn> <approval_id>``) scored by
        their expiry (ms); in a slot of its own, read and written with single-key commands."""
        return f"{self.prefix}:approval-expiry"

    def conversation_turns(self, conversation_id: str) -> str:
        """Sorted set: the conversation's turn ids, scored by creation time (ms)."""
        return f"{self.tag(conversation_id)}:turns"

    def viewer(self, conversation_id: str, token_id: str) -> str:
        """String with a PEXPIRE: the one connection a one-viewer attach token admits."""
        return f"{self.tag(conversation_id)}:viewer:{token_id}"

    def tenant_tag(self, tenant: str | None) -> str:
        return f"{self.prefix}:{{t:{tenant or OPEN_TENANT}}}"

    def turn_rate(self, tenant: str | None) -> str:
        """Hash: the tenant's token bucket for turn creation (tokens, last refill time)."""
        return f"{self.tenant_tag(tenant)}:rate"

    def live_streams(self, tenant: str | None) -> str:
        """Sorted set: the tenant's turns queued or generating, scored by a deadline (ms)."""
        return f"{self.tenant_tag(tenant)}:live"

    def retry_budget(self, session: str) -> str:
        """Sorted set: the times of a session's recent silent retries (a sliding window)."""
        return f"{self.prefix}:{{s:{session}}}:retries"

    def turn_index(self, turn_id: str) -> str:
        """String: turn id → conversation id (outlives the data as a tombstone)."""
        return f"{self.prefix}:turn-index:{turn_id}"

    def attach_secret(self, secured: bool) -> str:
        """String: the key that signs attach tokens when ``BROKER_ATTACH_SECRET`` is unset, one
        for a secured broker and one for an open one; global by nature, read once at start."""
        return f"{self.prefix}:attach-secret:{'secured' if secured else 'open'}"

    def stream_index(self, stream_id: str) -> str:
        """String: stream id → ``<conversation_id> <turn_id>`` (a tombstone outliving the data)."""
        return f"{self.prefix}:stream-index:{stream_id}"
