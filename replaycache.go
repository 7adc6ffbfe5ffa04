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
// The cache is bounded by the bytes it holds (bodies, headers and keys, plus
// a fixed overhead per entry) and evicts the least recently used entry.
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

// entryOverhead approximates the bytes an entry costs beyond its strings:
// the map slot, the list element, the structs and the digest.
const entryOverhead = 256

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
	size := int64(len(k.Source)+len(k.EventID)+len(s.body)+len(s.digest)) + entryOverhead
	for name, vs := range s.header {
		size += int64(len(name))
		for _, v := range vs {
			size += int64(len(v)) + 16
		}
	}
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
