"""The JAX record's reads: kept at a check, read once off the thread that dispatches the steps."""

import threading

__all__ = ["RecordReads"]


class RecordReads:
    """The record `NaNOnsetDetector` keeps at each check on JAX, and its one read.

    At a check the detector keeps a reference to the record the last step
    returned (`keep`); that step has finished by the next check, which acts
    on it (`take`). In between, a batch end in Keras's callback thread reads
    it (`read_kept`), so that the next check does not wait for the transfer;
    the check reads it itself only where no batch end has yet.

    Args:
        watch: the model's `nan_watch.OnsetWatch` (`start_read`, `finish_read`).
    """

    def __init__(self, watch):
        self._watch = watch
        self._pending = None  # the record kept at the last check
        self._read = None  # (record, its Onset), read in Keras's callback thread
        self._reading = threading.Lock()  # held by the callback thread reading it

    def keep(self):
        """Keeps a reference to the record the last step returned."""
        self._pending = self._watch.start_read()

    def drop(self):
        """Forgets the kept record, as at an epoch's end, which reads the record itself."""
        self._pending = None

    def read_kept(self):
        """Reads the kept record once, unless it is read or being read (a batch end's work)."""
        if self._unread(self._pending) and self._reading.acquire(blocking=False):
            try:
                pending = self._pending
                if self._unread(pending):
                    self._read = (pending, self._watch.finish_read(pending))
            finally:
                self._reading.release()

    def take(self):
        """The kept record's `Onset`, read now if no batch end read it; None if none is kept.

        The record is forgotten: the next check keeps a new one.
        """
        pending = self._pending
        if pending is None:
            return None
        self._pending = None
        onset = self._read_onset(pending)  # read in Keras's callback thread
        if onset is None:
            onset = self._watch.finish_read(pending)
        return onset

    def _read_onset(self, pending):
        """The `Onset` a callback thread read for `pending`, or None."""
        read = self._read
        return read[1] if read is not None and read[0] is pending else None

    def _unread(self, pending):
        """Whether `pending` (a kept record, or None) is still to be read."""
        return pending is not None and self._read_onset(pending) is None
