package idemnats

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pgidem/idem"
)

// heartbeat keeps one message alive while it is handled or held: at every
// beat, InProgress() (JetStream restarts the message's AckWait) and, while
// the handler runs in lease mode, idem.ExtendLease with the handler's
// context (the key's lease runs for Options.Lease again). One timer, no
// goroutine of its own between beats.
type heartbeat struct {
	c   *Consumer
	msg jetstream.Msg

	mu       sync.Mutex // held during a beat: stop waits for it
	t        *time.Timer
	stopped  bool
	fnCtx    context.Context // the running handler's, while it runs
	unleased bool            // ExtendLease said ErrNotLeased: not lease mode
}

func (c *Consumer) beat(msg jetstream.Msg) *heartbeat {
	h := &heartbeat{c: c, msg: msg}
	h.mu.Lock()
	h.t = time.AfterFunc(c.heartbeat, h.tick)
	h.mu.Unlock()
	return h
}

func (h *heartbeat) tick() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.stopped {
		return
	}
	if err := h.msg.InProgress(); err != nil {
		h.c.logger.Warn("idemnats: InProgress failed; the message may be redelivered while it is handled", "err", err)
	}
	if h.fnCtx != nil {
		switch err := idem.ExtendLease(h.fnCtx); {
		case errors.Is(err, idem.ErrNotLeased):
			h.unleased, h.fnCtx = true, nil
		case err != nil:
			h.c.logger.Warn("idemnats: extending the lease failed", "err", err)
		}
	}
	h.t.Reset(h.c.heartbeat)
}

// enter records the running handler's context, for ExtendLease.
func (h *heartbeat) enter(ctx context.Context) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.unleased {
		h.fnCtx = ctx
	}
}

// leave records the handler's end: no more lease to extend.
func (h *heartbeat) leave() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.fnCtx = nil
}

// stop ends the beats; a beat under way finishes first. It may be called
// more than once.
func (h *heartbeat) stop() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.stopped = true
	h.t.Stop()
}
