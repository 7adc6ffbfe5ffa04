package idem

import (
	"container/list"
	"sync"
	"time"
)

// replayCache keeps recently replayed answers in memory, so further
// duplicates of a key this instance has replayed are answered without a
// database round trip. Answers are cached when they are first replayed from
// the database, not when they complete: most events never get a duplicate,
// and caching every one would only feed the garbage collector (measured: a
// full cache of new events' answers cost new events a few microseconds
// each in GC marking). A
// completed row never changes, so an entry can only be stale in one way: the
// row was deleted (by the retention sweep, or by hand to have an event
// processed again). Entries expire after ttl to bound that; the digest is
// still checked on every hit. A duplicate of a key this instance has never
// seen goes to the database as usual.
//
// The cache is bounded by the bytes it holds on the heap (bodies, headers
// and keys, as allocated, and the structures that hold them) and evicts the
// least recently used entry.
type replayCache struct {
	mu       sync.Mutex
	max      int64
	ttl      time.Duration
	size     int64
	entries  map[Key]*list.Element
	lru      list.List // front: most recently used; values are *cacheEntry
	disabled bool
}

type cacheEntry struct {
	key     Key
	answer  *stored
	expires time.Time
	size    int64
}

// entryOverhead is what an entry costs on the heap beyond the allocations
// entrySize counts one by one: the cacheEntry (80 bytes), its list element
// (48), the stored struct (64), its slot in the entries map (64 and more,
// with the map's spare room and its growth), set so that the measured heap
// matches the count.
const entryOverhead = 336

// headerMapBase and headerMapGroup are the heap an http.Header costs beyond
// its names and values: the map header (48 bytes) and a group of 8 slots
// (352) for every 7 names (the map grows at 7/8 full).
const (
	headerMapBase  = 48
	headerMapGroup = 352
)

// entrySize is what an entry holds on the heap, as the allocator rounds
// each allocation: 200,000 small answers measured 1.03x of the count on the
// live heap (TestReplayCacheHoldsWhatItsSettingSays). Counting only the strings and
// bytes, as the cache once did, held 2.2x the setting for small answers.
func entrySize(k Key, s *stored) int64 {
	size := int64(entryOverhead) + allocSize(len(k.Source)) + allocSize(len(k.EventID)) +
		allocSize(cap(s.digest)) + allocSize(cap(s.body))
	if len(s.header) > 0 {
		size += headerMapBase + headerMapGroup*int64((len(s.header)+6)/7)
	}
	for name, vs := range s.header {
		size += allocSize(len(name)) + allocSize(16*cap(vs))
		for _, v := range vs {
			size += allocSize(len(v))
		}
	}
	return size
}

// allocSize is about what the allocator takes for n bytes: small objects
// come in classes 16 bytes apart, larger ones in classes up to an eighth
// apart.
func allocSize(n int) int64 {
	switch {
	case n <= 0:
		return 0
	case n <= 256:
		return int64(n+15) &^ 15
	}
	return int64(n + n/8)
}

func newReplayCache(maxBytes int64, ttl time.Duration) *replayCache {
	return &replayCache{max: maxBytes, ttl: ttl, entries: make(map[Key]*list.Element), disabled: maxBytes <= 0}
}

// get returns the stored answer of k, if this instance has it and it has not
// expired.
func (c *replayCache) get(k Key, now time.Time) (*stored, bool) {
	if c.disabled {
		return nil, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.entries[k]
	if !ok {
		return nil, false
	}
	e := el.Value.(*cacheEntry)
	if now.After(e.expires) {
		c.remove(el)
		return nil, false
	}
	c.lru.MoveToFront(el)
	return e.answer, true
}

// put remembers a completed answer. The cache owns s from here on: callers
// must not change it.
func (c *replayCache) put(k Key, s *stored, now time.Time) {
	if c.disabled {
		return
	}
	size := entrySize(k, s)
	if size > c.max/8 {
		return // one answer may not take more than an eighth of the cache
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.entries[k]; ok {
		c.remove(el)
	}
	c.entries[k] = c.lru.PushFront(&cacheEntry{key: k, answer: s, expires: now.Add(c.ttl), size: size})
	c.size += size
	for c.size > c.max {
		c.remove(c.lru.Back())
	}
}

func (c *replayCache) remove(el *list.Element) {
	e := c.lru.Remove(el).(*cacheEntry)
	delete(c.entries, e.key)
	c.size -= e.size
}

// len reports the number of entries, for tests.
func (c *replayCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.entries)
}
