package summary

import "time"

// What tests read or change of Summaries: knobs and counters kept apart
// from how claims use them.

// Set changes the margin, how often the partitions are listed, and how
// long a refresh waits for transactions (the defaults: a minute, 10 s,
// 2 s); for tests.
func (s *Summaries) Set(margin, every, drain time.Duration) {
	s.margin.Store(int64(margin))
	s.every.Store(int64(every))
	s.drain.Store(int64(drain))
}

// Disable makes every claim lock-first; for tests.
func (s *Summaries) Disable() { s.off.Store(true) }

// Skew moves the clock Fast reads by d; for tests.
func (s *Summaries) Skew(d time.Duration) { s.skew.Store(int64(d)) }

// Ready reports whether the last refresh summarised every past partition,
// so that claims may be fast.
func (s *Summaries) Ready() bool {
	st := s.state.Load()
	return st != nil && st.usable
}

// FastClaims is how many claims Fast has sent to the current partition as
// on a plain table, NarrowClaims how many there after looking for the key
// in some past partitions, PastAnswers how many answers Answered read.
func (s *Summaries) FastClaims() int64 { return s.fast.Load() }

// PastAnswers: see FastClaims.
func (s *Summaries) PastAnswers() int64 { return s.answers.Load() }

// NarrowClaims: see FastClaims.
func (s *Summaries) NarrowClaims() int64 { return s.narrow.Load() }
