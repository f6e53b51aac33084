"""`RecordReads`: the JAX record kept at a check is read once, off the dispatching thread when a batch end comes first."""

import threading

from keras_safe_dist.nan._record_reads import RecordReads


class FakeWatch:
    """Counts the reads; each kept record is a fresh object, its onset a tuple naming it."""

    def __init__(self):
        self.kept = 0
        self.finished = []

    def start_read(self):
        self.kept += 1
        return object()

    def finish_read(self, record):
        self.finished.append(record)
        return ("onset", len(self.finished))


def test_nothing_kept_is_nothing_to_take_and_nothing_to_read():
    watch = FakeWatch()
    reads = RecordReads(watch)
    reads.read_kept()
    assert reads.take() is None
    assert watch.finished == []


def test_a_record_read_at_a_batch_end_is_taken_without_a_second_read():
    watch = FakeWatch()
    reads = RecordReads(watch)
    reads.keep()
    reads.read_kept()
    reads.read_kept()  # already read: no second transfer
    assert len(watch.finished) == 1
    assert reads.take() == ("onset", 1)
    assert len(watch.finished) == 1
    assert reads.take() is None  # taken once


def test_a_record_no_batch_end_read_is_read_when_taken():
    watch = FakeWatch()
    reads = RecordReads(watch)
    reads.keep()
    assert reads.take() == ("onset", 1)
    assert len(watch.finished) == 1


def test_a_new_record_is_read_again_and_a_dropped_one_is_not_taken():
    watch = FakeWatch()
    reads = RecordReads(watch)
    reads.keep()
    reads.read_kept()
    reads.take()
    reads.keep()  # the next check's record: not the one read before
    reads.read_kept()
    assert len(watch.finished) == 2
    reads.keep()
    reads.drop()
    assert reads.take() is None
    assert len(watch.finished) == 2


def test_a_batch_end_that_finds_the_record_being_read_does_not_wait_or_read_it_again():
    watch = FakeWatch()
    reads = RecordReads(watch)
    reads.keep()
    started, release = threading.Event(), threading.Event()
    finish = watch.finish_read

    def slow_finish(record):
        started.set()
        assert release.wait(10)
        return finish(record)

    watch.finish_read = slow_finish
    reader = threading.Thread(target=reads.read_kept)
    reader.start()
    assert started.wait(10)
    reads.read_kept()  # returns at once: the lock is held
    release.set()
    reader.join(10)
    assert not reader.is_alive()
    assert len(watch.finished) == 1
    assert reads.take() == ("onset", 1)
    assert len(watch.finished) == 1
