package summary

import (
	"hash/maphash"
	"strconv"
	"testing"

	"github.com/pgidem/idem/internal/driver"
)

// A Bloom filter never rules out a key it holds, and rules out nearly every
// other: at 24 bits per key and 8 probes, about one in 24,000 gets through.
func TestBloomHoldsItsKeysAndFewOthers(t *testing.T) {
	s := &Summaries{seed: maphash.MakeSeed()}
	const n = 50_000
	f := newBloom(n)
	for i := 0; i < n; i++ {
		f.add(s.hash(&driver.Args{Source: "stripe POST /hook", EventID: "evt_" + strconv.Itoa(i)}))
	}
	for i := 0; i < n; i++ {
		if !f.has(s.hash(&driver.Args{Source: "stripe POST /hook", EventID: "evt_" + strconv.Itoa(i)})) {
			t.Fatalf("evt_%d added but ruled out", i)
		}
	}
	var passed int
	for i := n; i < 11*n; i++ {
		if f.has(s.hash(&driver.Args{Source: "stripe POST /hook", EventID: "evt_" + strconv.Itoa(i)})) {
			passed++
		}
	}
	if rate := float64(passed) / (10 * n); rate > 1.0/10000 {
		t.Fatalf("%d of %d other keys got through (%.5f)", passed, 10*n, rate)
	}
	// The separator keeps the source and the event id apart.
	if s.hash(&driver.Args{Source: "a", EventID: "bc"}) == s.hash(&driver.Args{Source: "ab", EventID: "c"}) {
		t.Fatal("a/bc and ab/c hash alike")
	}
	if empty := newBloom(0); empty.has(s.hash(&driver.Args{Source: "a", EventID: "b"})) {
		t.Fatal("an empty partition's filter holds a key")
	}
}

// A filter of a partition with a few keys rules out other keys as well as a
// large one does. With one hash split in two (probe i at h1 + i·h2 mod m), a
// 64-bit filter knows only 2,048 probe patterns, and one key in a few
// hundred shared a pattern with one of two keys held: a new key then read
// a past partition it was never in (a test that counted those claims failed
// in CI once).
func TestBloomOfAFewKeysRulesOutOthers(t *testing.T) {
	if f := newBloom(2); f.m < 64*minBloomWords {
		t.Fatalf("a filter of two keys has %d bits, fewer than %d", f.m, 64*minBloomWords)
	}
	var passed, tried int
	for seed := 0; seed < 2_000; seed++ {
		s := &Summaries{seed: maphash.MakeSeed()}
		f := newBloom(2)
		f.add(s.hash(&driver.Args{Source: "test", EventID: "evt_crashed"}))
		f.add(s.hash(&driver.Args{Source: "test", EventID: "evt_running"}))
		for i := 0; i < 100; i++ {
			tried++
			if f.has(s.hash(&driver.Args{Source: "test", EventID: "evt_" + strconv.Itoa(i)})) {
				passed++
			}
		}
	}
	if passed > 0 {
		t.Fatalf("%d of %d other keys got through a filter of two", passed, tried)
	}
}
