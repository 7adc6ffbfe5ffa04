package idem

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// flights lets the deliveries of one key on this instance run one at a time.
// The first to enter runs (claims, waits in PostgreSQL if it must, replays or
// runs the handler); the others wait in memory, without a connection, until
// it leaves, then try again: by then the answer is usually in the replay
// cache, or the key is free to claim because the run rolled back. So the
// duplicates of a hot key hold no pooled connection while they wait.
type flights struct {
	mu      sync.Mutex
	m       map[Key]chan struct{}
	waiters atomic.Int64 // deliveries waiting in memory for a key's runner
}

// enter makes the caller the key's runner on this instance and returns nil,
// or returns a channel that closes when the current runner leaves. The
// channel is made for the first waiter: most keys never have one.
func (f *flights) enter(k Key) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if c, ok := f.m[k]; ok {
		if c == nil {
			c = make(chan struct{})
			f.m[k] = c
		}
		return c
	}
	if f.m == nil {
		f.m = make(map[Key]chan struct{})
	}
	f.m[k] = nil
	return nil
}

// leave ends the caller's run of the key and wakes its waiters.
func (f *flights) leave(k Key) {
	f.mu.Lock()
	c := f.m[k]
	delete(f.m, k)
	f.mu.Unlock()
	if c != nil {
		close(c)
	}
}

// waitSlots bounds how many claims wait in PostgreSQL for an original at
// once, each holding a pooled connection: a quarter of the pool's cap, at
// least one. The others wait in memory for a slot.
type waitSlots struct {
	mu    sync.Mutex
	used  int
	freed chan struct{} // closed and replaced whenever a slot is released
}

// tryAcquire takes a slot if one of limit is free.
func (s *waitSlots) tryAcquire(limit int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.used >= limit {
		return false
	}
	s.used++
	return true
}

// acquire takes a slot, waiting in memory until deadline or ctx ends; it
// reports whether it got one.
func (s *waitSlots) acquire(ctx context.Context, limit int, deadline time.Time) bool {
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for {
		s.mu.Lock()
		if s.used < limit {
			s.used++
			s.mu.Unlock()
			return true
		}
		if s.freed == nil {
			s.freed = make(chan struct{})
		}
		freed := s.freed
		s.mu.Unlock()
		select {
		case <-freed:
		case <-timer.C:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

func (s *waitSlots) release() {
	s.mu.Lock()
	s.used--
	if s.freed != nil {
		close(s.freed)
		s.freed = nil
	}
	s.mu.Unlock()
}

// waitLimit is how many claims may wait in PostgreSQL at once, for a pool
// capped at maxOpen connections (0: no cap).
func waitLimit(maxOpen int) int {
	if maxOpen <= 0 {
		return uncappedWaitLimit
	}
	return max(1, maxOpen/4)
}

// uncappedWaitLimit is waitLimit for a pool without a cap.
const uncappedWaitLimit = 16

// await waits for c (from enter) to close until deadline or ctx ends (a
// call of Do whose caller gives up; an HTTP request's never does); it
// reports whether c closed.
func (f *flights) await(ctx context.Context, c <-chan struct{}, deadline time.Time) bool {
	f.waiters.Add(1)
	defer f.waiters.Add(-1)
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case <-c:
		return true
	case <-timer.C:
		return false
	case <-ctx.Done():
		return false
	}
}
