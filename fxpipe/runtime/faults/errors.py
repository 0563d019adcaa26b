"""Errors the runtime raises: bad setup, bad batches, and failed or timed-out communication."""

from __future__ import annotations


class PipelineSetupError(ValueError):
    """The plan, program and process group do not fit together (world size, missing loss_fn, ...)."""


class BatchShapeError(ValueError):
    """A step's inputs or targets do not have the shapes the plan and receive buffers were made for."""


class CommunicationError(RuntimeError):
    """A send, receive or collective failed or timed out; the message names the peer rank and the value."""


class RemoteSetupError(PipelineSetupError):
    """Another rank failed while the pipeline was being set up; the message names that rank, the phase and
    its original error (every rank raises at the same phase, so none waits for a timeout)."""


class LossReductionError(PipelineSetupError):
    """``loss_fn`` is not what ``loss_reduction`` needs (or ``"auto"`` found): found by the loss probe on the
    first step and raised on every rank after it, with that step's gradients dropped (fxpipe.runtime.numerics.loss_probe)."""


class MessageLayoutError(RuntimeError):
    """A message between stages does not hold what its receiver expects (another dtype, size or piece count), or
    a stage would send a value in another dtype or shape than the plan's layout: raised instead of reading memory
    nobody wrote. The message names the value, the stages and both layouts."""


class LossFunctionError(PipelineSetupError, TypeError):
    """``loss_fn`` cannot be the loss: it does not take ``(output, targets)``, or on the example output it returns
    no scalar (no ``(sum, count)`` pair for ``"token_mean"``); raised at compile on every rank
    (fxpipe.runtime.loss_check). Both a ValueError and a TypeError."""


class TrainableSetChangedError(ValueError):
    """A parameter's ``requires_grad`` changed after ``fxpipe.compile``, which set up the gradient sums for the
    parameters that trained then (fxpipe.runtime.gradients.trainable); raised at the next ``step`` on the ranks whose stage
    holds it (the others then name it as the job's first failure)."""
