package main

import (
	"fmt"
	"io"
	"os"
	"time"
)

// progress prints the storm's counters while it runs: one line rewritten in
// place on a terminal, a line every two seconds otherwise.
type progress struct {
	w       io.Writer
	st      *storm
	tty     bool
	done    chan struct{}
	stopped chan struct{}
}

func newProgress(w io.Writer, st *storm) *progress {
	p := &progress{w: w, st: st, done: make(chan struct{}), stopped: make(chan struct{})}
	if f, ok := w.(*os.File); ok {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			p.tty = true
		}
	}
	return p
}

func (p *progress) start() { go p.loop() }

// stop prints the last line and returns when the printing has stopped.
func (p *progress) stop() {
	close(p.done)
	<-p.stopped
}

func (p *progress) loop() {
	defer close(p.stopped)
	every := 2 * time.Second
	if p.tty {
		every = 200 * time.Millisecond
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-p.done:
			if p.tty {
				fmt.Fprintf(p.w, "\r%s\x1b[K\n", p.line())
			}
			return
		case <-tick.C:
			if p.tty {
				fmt.Fprintf(p.w, "\r%s\x1b[K", p.line())
			} else {
				fmt.Fprintln(p.w, p.line())
			}
		}
	}
}

func (p *progress) line() string {
	st := p.st
	return fmt.Sprintf("  %d/%d events done · %d requests answered · %d × 409 retried · %d × 422",
		st.eventsDone.Load(), len(st.events), st.answered.Load(), st.conflicts.Load(), st.mismatches.Load())
}
