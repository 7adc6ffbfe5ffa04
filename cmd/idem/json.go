package main

import (
	"encoding/json"
	"io"
	"time"

	"github.com/pgidem/idem/idemops"
)

// The documents of check -json and stats -json (docs/operations.md has the
// schema): snake_case names, times in RFC 3339 UTC or null, durations in
// whole seconds, lists empty rather than null. A field is only ever added.

type checkDoc struct {
	Status              string        `json:"status"` // "ok", "warning" or "critical"
	CheckedAt           string        `json:"checked_at"`
	Table               string        `json:"table"`
	TableBytes          int64         `json:"table_bytes"`
	Keys                int64         `json:"keys"`
	OldestKey           *string       `json:"oldest_key"`
	OldestAgeSeconds    int64         `json:"oldest_age_seconds"`
	HorizonSeconds      int64         `json:"horizon_seconds"`
	RetentionSeconds    int64         `json:"retention_seconds"`
	OverdueGraceSeconds int64         `json:"overdue_grace_seconds"`
	StuckAfterSeconds   int64         `json:"stuck_after_seconds"`
	OverdueKeys         int64         `json:"overdue_keys"`
	UnansweredKeys      int64         `json:"unanswered_keys"`
	LiveLeases          int64         `json:"live_leases"`
	ExpiredLeases       int64         `json:"expired_leases"`
	InFlight            int           `json:"in_flight"`
	Partitions          *partitionDoc `json:"partitions"` // null for a plain table
	Durability          durabilityDoc `json:"durability"`
	Findings            []findingDoc  `json:"findings"`
	StuckClaims         []claimDoc    `json:"stuck_claims"`
	Unanswered          []keyDoc      `json:"unanswered"`
	ExpiredLeaseKeys    []keyDoc      `json:"expired_lease_keys"`
}

type partitionDoc struct {
	Count   int     `json:"count"`
	Current *string `json:"current"`
	Ahead   int     `json:"ahead"`
	Until   *string `json:"until"`
}

type durabilityDoc struct {
	Summary                 string   `json:"summary"`
	Synchronous             bool     `json:"synchronous"`
	Required                bool     `json:"required"`
	InRecovery              bool     `json:"in_recovery"`
	SynchronousCommit       string   `json:"synchronous_commit"`
	SynchronousStandbyNames string   `json:"synchronous_standby_names"`
	SyncStandbys            []string `json:"sync_standbys"`
}

type findingDoc struct {
	Severity string `json:"severity"`
	Check    string `json:"check"`
	What     string `json:"what"`
	Action   string `json:"action"`
}

type claimDoc struct {
	PID         int    `json:"pid"`
	AgeSeconds  int64  `json:"age_seconds"`
	State       string `json:"state"`
	Application string `json:"application"`
	Client      string `json:"client"`
	Query       string `json:"query"`
}

type keyDoc struct {
	Source    string `json:"source"`
	EventID   string `json:"event_id"`
	ClaimedAt string `json:"claimed_at"`
}

func reportJSON(r *idemops.Report) checkDoc {
	d := checkDoc{
		Status: r.Severity().String(), CheckedAt: stamp(r.CheckedAt),
		Table: r.Table, TableBytes: r.TableBytes, Keys: r.Rows,
		OldestKey: stampOrNull(r.OldestKey), OldestAgeSeconds: secs(r.OldestAge),
		HorizonSeconds: secs(r.Horizon), RetentionSeconds: secs(r.Retention),
		OverdueGraceSeconds: secs(r.OverdueGrace), StuckAfterSeconds: secs(r.StuckAfter),
		OverdueKeys: r.OverdueRows, UnansweredKeys: r.Unanswered,
		LiveLeases: r.LiveLeases, ExpiredLeases: r.ExpiredLeases, InFlight: r.InFlight,
		Durability: durabilityDoc{
			Summary: r.Durability.Summary, Synchronous: r.Durability.Synchronous(), Required: r.RequireSynchronous,
			InRecovery: r.Durability.InRecovery, SynchronousCommit: r.Durability.SynchronousCommit,
			SynchronousStandbyNames: r.Durability.SynchronousStandbyNames,
			SyncStandbys:            append([]string{}, r.Durability.SyncStandbys...),
		},
		Findings:         []findingDoc{},
		StuckClaims:      []claimDoc{},
		Unanswered:       keyDocs(r.UnansweredKeys),
		ExpiredLeaseKeys: keyDocs(r.ExpiredLeaseKeys),
	}
	if r.Partitioned {
		d.Partitions = &partitionDoc{Count: len(r.Partitions), Ahead: r.PartitionsAhead, Until: stampOrNull(r.PartitionedUntil)}
		if r.CurrentPartition != "" {
			d.Partitions.Current = &r.CurrentPartition
		}
	}
	for _, f := range r.Findings {
		d.Findings = append(d.Findings, findingDoc{f.Severity.String(), f.Check, f.What, f.Action})
	}
	for _, c := range r.Stuck {
		d.StuckClaims = append(d.StuckClaims, claimDoc{c.PID, secs(c.Age), c.State, c.Application, c.Client, c.Query})
	}
	return d
}

func keyDocs(keys []idemops.UnansweredKey) []keyDoc {
	out := []keyDoc{}
	for _, k := range keys {
		out = append(out, keyDoc{k.Key.Source, k.Key.EventID, stamp(k.ClaimedAt)})
	}
	return out
}

type statsDoc struct {
	Table           string         `json:"table"`
	TableBytes      int64          `json:"table_bytes"`
	Keys            int64          `json:"keys"`
	Completed       int64          `json:"completed"`
	Unanswered      int64          `json:"unanswered"`
	LiveLeases      int64          `json:"live_leases"`
	ExpiredLeases   int64          `json:"expired_leases"`
	InFlight        int            `json:"in_flight"`
	OldestKey       *string        `json:"oldest_key"`
	NewestKey       *string        `json:"newest_key"`
	Partitions      []partStatsDoc `json:"partitions"` // empty for a plain table
	PartitionsAhead int            `json:"partitions_ahead"`
	Sources         []sourceDoc    `json:"sources"`
	OtherSources    int            `json:"other_sources"`
}

type partStatsDoc struct {
	Name  string  `json:"name"`
	From  *string `json:"from"`
	To    *string `json:"to"`
	Keys  int64   `json:"keys"`
	Bytes int64   `json:"bytes"`
}

type sourceDoc struct {
	Source     string `json:"source"`
	Completed  int64  `json:"completed"`
	Unanswered int64  `json:"unanswered"`
	Leases     int64  `json:"leases"`
	Oldest     string `json:"oldest"`
	Newest     string `json:"newest"`
}

func statsJSON(s *idemops.TableStats) statsDoc {
	d := statsDoc{
		Table: s.Table, TableBytes: s.TableBytes, Keys: s.Rows, Completed: s.Completed, Unanswered: s.Unanswered,
		LiveLeases: s.LiveLeases, ExpiredLeases: s.ExpiredLeases, InFlight: s.InFlight,
		OldestKey: stampOrNull(s.Oldest), NewestKey: stampOrNull(s.Newest),
		Partitions: []partStatsDoc{}, PartitionsAhead: s.PartitionsAhead,
		Sources: []sourceDoc{}, OtherSources: s.OtherSources,
	}
	for _, p := range s.Partitions {
		d.Partitions = append(d.Partitions, partStatsDoc{p.Name, stampOrNull(p.From), stampOrNull(p.To), p.Rows, p.Bytes})
	}
	for _, src := range s.Sources {
		d.Sources = append(d.Sources, sourceDoc{src.Source, src.Completed, src.Unanswered, src.Leases, stamp(src.Oldest), stamp(src.Newest)})
	}
	return d
}

// writeJSON writes v as one indented JSON document.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// stampOrNull is stamp, or nil (null) for the zero time.
func stampOrNull(t time.Time) *string {
	if t.IsZero() {
		return nil
	}
	s := stamp(t)
	return &s
}

// secs is d in whole seconds, rounded down.
func secs(d time.Duration) int64 { return int64(d / time.Second) }
