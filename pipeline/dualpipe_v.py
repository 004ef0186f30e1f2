"""DualPipeV: DeepSeek's V-shaped schedule that overlaps one micro-batch's forward with
another's backward (``OpKind.FB``, F&B), on ``S`` devices for ``2S`` chunks.

The op orders are DeepSeek's (``deepseek-ai/DualPipe``, ``dualpipev.py``, the "cut-in-half"
of DualPipe by Sea AI Lab), step for step. Stage ``s`` runs chunk ``s`` on the way down
(DualPipe's phase 0) and chunk ``2S-1-s`` on the way back (phase 1), as ZB-V places them
(``schedules.chunk_stage``). Each phase takes its micro-batches in order; a backward "with
zero bubble" is a B_in whose W is queued, and W runs the queue's oldest. DualPipe's
published figures hold for the table (``tests/test_dualpipe_v.py``): per device the
bubble is ``(S-1)(F&B + B - 3W)`` (DualPipe's ``(PP/2-1)(F&B + B - 3W)`` with ``PP = 2S``
stages) when B_in takes as long as F and W no longer, and every stage holds ``2S+1``
chunks in flight (``PP+1``).

    >>> from triax.pipeline import build
    >>> s = build("dualpipev", stages=2, microbatches=4)
    >>> s.virtual, s.peak_in_flight, s.idle_times()
    (2, 5, [2.0, 2.0])
"""
from __future__ import annotations

from triax.pipeline.schedules import Op, OpKind, ScheduleError

F, B, B_IN, W, FB = OpKind.F, OpKind.B, OpKind.B_IN, OpKind.W, OpKind.FB


class _Stage:
    """One device's order as DualPipe's ``step`` writes it: per phase a forward and a
    backward cursor over the micro-batches, and the queue of B_in's awaiting their W."""

    def __init__(self, s: int, S: int):
        self.chunk = (s, 2 * S - 1 - s)
        self.next_f, self.next_b = [0, 0], [0, 0]
        self.queue: list[tuple[int, int]] = []
        self.order: list[Op] = []

    def _f(self, p: int) -> tuple[int, int]:
        self.next_f[p] += 1
        return self.next_f[p] - 1, self.chunk[p]

    def _b(self, p: int) -> tuple[int, int]:
        self.next_b[p] += 1
        return self.next_b[p] - 1, self.chunk[p]

    def forward(self, p: int) -> None:
        self.order.append(Op(F, *self._f(p)))

    def backward(self, p: int, zero_bubble: bool = False) -> None:
        mb, c = self._b(p)
        self.order.append(Op(B_IN if zero_bubble else B, mb, c))
        if zero_bubble:
            self.queue.append((mb, c))

    def weight(self) -> None:
        self.order.append(Op(W, *self.queue.pop(0)))

    def overlapped(self, pf: int, pb: int) -> None:
        mb, c = self._f(pf)
        b_mb, b_c = self._b(pb)
        self.order.append(Op(FB, mb, c, b_mb, b_c))


def dualpipe_v_orders(S: int, M: int, v: int) -> list[list[Op]]:
    """Every stage's order, DualPipe's eight steps (``dualpipev.py``, ``step``); needs
    ``M >= 2S`` (DualPipe's own assertion: the warm-up fills both legs)."""
    if M < 2 * S:
        raise ScheduleError(f"dualpipev needs microbatches >= 2 x stages to fill both legs of "
                            f"its V: M={M} < {2 * S} for S={S} (choose M >= {2 * S})")
    orders = []
    for s in range(S):
        st = _Stage(s, S)
        for _ in range((S - s - 1) * 2):        # 1: nF0
            st.forward(0)
        for _ in range(s + 1):                  # 2: nF0F1
            st.forward(0)
            st.forward(1)
        for _ in range(S - s - 1):              # 3: nB1W1F1, zero bubble
            st.backward(1, zero_bubble=True)
            st.weight()
            st.forward(1)
        for i in range(M - 2 * S + s + 1):      # 4: nF0B1F1B0, the overlapped main step
            if i == 0 and s == S - 1:           # DualPipe runs these two apart on purpose
                st.forward(0)
                st.backward(1)
            else:
                st.overlapped(0, 1)
            st.overlapped(1, 0)
        for _ in range(S - s - 1):              # 5: nB1F1B0
            st.backward(1)
            st.overlapped(1, 0)
        _cool_down(st, s, S)
        orders.append(st.order)
    return orders


def _cool_down(st: _Stage, s: int, S: int) -> None:
    """DualPipe's steps 6-8: the last backwards, the second half of them with zero bubble,
    then the queued W's."""
    zero_bubble = False
    for i in range(s + 1):                      # 6: nB1B0
        if i == (s + 1) // 2 and s % 2 == 1:
            zero_bubble = True
        st.backward(1, zero_bubble)
        if i == (s + 1) // 2 and s % 2 == 0:
            zero_bubble = True
        st.backward(0, zero_bubble)
    for _ in range(S - s - 1):                  # 7: nWB0, zero bubble
        st.weight()
        st.backward(0, zero_bubble=True)
    for _ in range(s + 1):                      # 8: nW
        st.weight()
