"""Every error the library raises, under one base: `except RollstreamError` catches any of them.

Each error also keeps the built-in base it had before there was a common one (ValueError for bad
input, RuntimeError for a failure of the machinery), so code that caught those still does. The
services' and the command line's own errors derive from RollstreamError too, beside their code.
"""

from __future__ import annotations


class RollstreamError(Exception):
    """Base of every error rollstream raises."""


# --- contract: events, streams, archive ----------------------------------------------------------


class EventDecodeError(RollstreamError, ValueError):
    """A stream entry is not a valid event (unknown type or version, bad payload)."""


class ArchiveError(RollstreamError):
    """A stream archive cannot be read or written as it should (damaged or overlapping parts)."""


class UnknownRole(RollstreamError, ValueError):
    """A sample, a session or a row names a role the run does not have (roles.names)."""


class RunDataNotFound(RollstreamError, LookupError):
    """A run or a rollout asked for is in neither Redis nor storage; the message says what is there."""


# --- runtime -------------------------------------------------------------------------------------


class TrackingError(RollstreamError, RuntimeError):
    """An experiment tracker cannot be set up (unknown name, package missing)."""


# --- inference -----------------------------------------------------------------------------------


class FleetUnavailable(RollstreamError, RuntimeError):
    """No healthy vLLM server is left to send a request to."""


class FleetRequestError(RollstreamError, RuntimeError):
    """A vLLM server answered a request with an error, or an answer we cannot use."""


class WeightSyncError(RollstreamError, RuntimeError):
    """A server did not take the new weights (reload failed, or logprob parity was off)."""


class ServingCheckpointError(RollstreamError, RuntimeError):
    """A checkpoint cannot be written in the layout the inference servers load."""


# --- tasks and datasets --------------------------------------------------------------------------


class DatasetError(RollstreamError, ValueError):
    """The dataset cannot be used; the message names the file and the row."""


class TaskError(RollstreamError, ValueError):
    """A Harbor task or SWE-bench row is invalid; the message names the file and the field."""


# --- sandbox -------------------------------------------------------------------------------------


class SandboxError(RollstreamError, RuntimeError):
    """The sandbox could not be set up for this call."""


class SandboxUnavailable(SandboxError):
    """bubblewrap (`bwrap`) is not installed on this host."""


class WorkspaceError(SandboxError):
    """The workspace is missing, not a directory, out of the sandbox user's reach, or git could not
    record or apply its changes."""


class BackendUnavailable(SandboxError):
    """The sandbox backend cannot run anything here (no bwrap, no Docker engine, ...)."""


# --- grading -------------------------------------------------------------------------------------


class GradingError(RollstreamError, RuntimeError):
    """Grading could not be set up (not the diff's fault)."""


# --- agents --------------------------------------------------------------------------------------


class TemplateError(RollstreamError, RuntimeError):
    """The tokenizer's chat template cannot render a conversation the way the agent loop needs."""


class ToolError(RollstreamError):
    """A tool call failed in a way the model should be told about (bad arguments, refused path);
    the agent loop turns it into a tool message and the episode goes on."""


class CodingTaskError(RollstreamError, ValueError):
    """The row's metadata does not describe a usable coding task (a dataset problem)."""
