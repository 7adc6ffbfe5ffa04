package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
)

// idem keys show|list|forget: one key at a time (idemops.ShowKey,
// ListKeys, ForgetKey).

// Exit codes of idem keys, beside exitOK and exitFailed.
const (
	exitNotFound = 4 // keys show, keys forget: no such key
	exitRefused  = 5 // keys forget: in flight or under a live lease, without -force
)

// keyFlags adds -source and -id, and returns a check that both are set.
func keyFlags(fs *flag.FlagSet) func() (idem.Key, error) {
	source := fs.String("source", "", "the key's source, exactly as stored (required)")
	id := fs.String("id", "", "the key's event id, exactly as stored (required)")
	return func() (idem.Key, error) {
		if *source == "" || *id == "" {
			return idem.Key{}, errors.New("-source and -id are required")
		}
		return idem.Key{Source: *source, EventID: *id}, nil
	}
}

func keysShowFlags(fs *flag.FlagSet) func(context.Context, *sql.DB, string, io.Writer, io.Writer) (int, error) {
	key := keyFlags(fs)
	body := fs.Bool("body", false, "print the stored response body too (off by default: bodies can hold personal data)")
	asJSON := fs.Bool("json", false, "print the key as one JSON document (docs/operations.md)")
	return func(ctx context.Context, db *sql.DB, table string, stdout, stderr io.Writer) (int, error) {
		k, err := key()
		if err != nil {
			return 0, err
		}
		info, err := idemops.ShowKey(ctx, db, idemops.KeyOptions{Table: table, Key: k, Body: *body})
		if errors.Is(err, idemops.ErrKeyNotFound) {
			return notFound(stdout, *asJSON, k)
		}
		if err != nil {
			return 0, err
		}
		if *asJSON {
			return exitOK, writeJSON(stdout, keyJSON(info, *body))
		}
		printKey(stdout, info)
		if *body {
			fmt.Fprintf(stdout, "body:\n%s\n", printable(info.Body))
		}
		return exitOK, nil
	}
}

// notFound reports a missing key: a line, or {"found": false}.
func notFound(stdout io.Writer, asJSON bool, k idem.Key) (int, error) {
	if asJSON {
		return exitNotFound, writeJSON(stdout, map[string]any{"found": false, "source": k.Source, "event_id": k.EventID})
	}
	fmt.Fprintf(stdout, "no key source %q event_id %q: never delivered, rolled back every time, or swept\n", k.Source, k.EventID)
	return exitNotFound, nil
}

func printKey(w io.Writer, k *idemops.KeyInfo) {
	fmt.Fprintf(w, "key: source %q event_id %q\n", k.Key.Source, k.Key.EventID)
	fmt.Fprintf(w, "state: %s\n", stateText(k))
	if k.State == idemops.KeyInFlight {
		return
	}
	fmt.Fprintf(w, "claimed: %s (%s ago)\n", stamp(k.ClaimedAt), age(k.CheckedAt.Sub(k.ClaimedAt)))
	if !k.CompletedAt.IsZero() {
		fmt.Fprintf(w, "completed: %s (after %v)\n", stamp(k.CompletedAt), k.CompletedAt.Sub(k.ClaimedAt).Round(time.Millisecond))
	}
	if !k.LeaseUntil.IsZero() {
		fmt.Fprintf(w, "lease until: %s\n", stamp(k.LeaseUntil))
	}
	if k.Status != 0 {
		fmt.Fprintf(w, "status: %d\n", k.Status)
		fmt.Fprintf(w, "headers:%s\n", headerText(k))
		fmt.Fprintf(w, "body: %d bytes\n", k.BodySize)
	}
	fmt.Fprintf(w, "request body sha256: %s\n", k.PayloadDigest)
	if k.Partition != "" {
		fmt.Fprintf(w, "partition: %s\n", k.Partition)
	}
	if k.InFlight {
		fmt.Fprintf(w, "lock: held by session pid %d\n", k.HolderPID)
	}
}

// stateText says what a key's state means for its next delivery.
func stateText(k *idemops.KeyInfo) string {
	switch k.State {
	case idemops.KeyCompleted:
		return "completed: every redelivery is answered with the stored answer"
	case idemops.KeyUnanswered:
		return "unanswered: committed without an answer; every redelivery is answered 409 until resolved (idem keys forget, docs/operations.md)"
	case idemops.KeyLeased:
		return fmt.Sprintf("leased: its handler is at work; the lease ends in %v", k.LeaseUntil.Sub(k.CheckedAt).Round(time.Second))
	case idemops.KeyLeaseExpired:
		return fmt.Sprintf("lease expired %v ago without an answer: the next delivery takes it over and runs the handler", k.CheckedAt.Sub(k.LeaseUntil).Round(time.Second))
	case idemops.KeyInFlight:
		return fmt.Sprintf("in flight: no committed row; session pid %d holds its lock (a claim not yet committed; idem check lists it when stuck)", k.HolderPID)
	}
	return k.State.String()
}

func headerText(k *idemops.KeyInfo) string {
	if len(k.Headers) == 0 {
		return " none"
	}
	names := make([]string, 0, len(k.Headers))
	for n := range k.Headers {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	for _, n := range names {
		for _, v := range k.Headers[n] {
			fmt.Fprintf(&b, "\n  %s: %q", n, v)
		}
	}
	return b.String()
}

func keysListFlags(fs *flag.FlagSet) func(context.Context, *sql.DB, string, io.Writer, io.Writer) (int, error) {
	state := fs.String("state", "all", "which keys: unanswered, stuck (unanswered or lease expired), leased, expired or all")
	source := fs.String("source", "", "only the keys of this source (default: every source)")
	since := fs.Duration("since", 0, "only the keys claimed within this long (default: any age)")
	limit := fs.Int("limit", idemops.DefaultListLimit, fmt.Sprintf("the most keys listed, newest first (at most %d)", idemops.MaxListLimit))
	asJSON := fs.Bool("json", false, "print the keys as one JSON document (docs/operations.md)")
	return func(ctx context.Context, db *sql.DB, table string, stdout, stderr io.Writer) (int, error) {
		switch {
		case *limit <= 0 || *limit > idemops.MaxListLimit:
			return 0, fmt.Errorf("-limit must be 1 to %d", idemops.MaxListLimit)
		case *since < 0:
			return 0, errors.New("-since must not be negative")
		}
		opts := idemops.ListOptions{Table: table, State: idemops.ListState(*state), Source: *source, Limit: *limit}
		if *since > 0 {
			opts.Since = time.Now().Add(-*since)
		}
		keys, err := idemops.ListKeys(ctx, db, opts)
		if err != nil {
			return 0, err
		}
		if *asJSON {
			docs := []keyInfoDoc{}
			for i := range keys {
				docs = append(docs, keyJSON(&keys[i], false))
			}
			return exitOK, writeJSON(stdout, docs)
		}
		if len(keys) == 0 {
			fmt.Fprintf(stdout, "no %s keys\n", *state)
			return exitOK, nil
		}
		tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "SOURCE\tEVENT ID\tSTATE\tCLAIMED\tSTATUS")
		for _, k := range keys {
			status := "-"
			if k.Status != 0 {
				status = fmt.Sprint(k.Status)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", quoteIfNeeded(k.Key.Source), quoteIfNeeded(k.Key.EventID), k.State, stamp(k.ClaimedAt), status)
		}
		_ = tw.Flush()
		if len(keys) == *limit {
			fmt.Fprintf(stdout, "(the newest %d; more may match: raise -limit or narrow -since)\n", *limit)
		}
		return exitOK, nil
	}
}

// quoteIfNeeded quotes s when it holds spaces, quotes or characters a
// terminal would act on, so that a list stays one key per line.
func quoteIfNeeded(s string) string {
	for _, r := range s {
		if r <= ' ' || r == '"' || r == '\\' || r == 0x7f || !utf8.ValidString(s) {
			return fmt.Sprintf("%q", s)
		}
	}
	return s
}

func keysForgetFlags(fs *flag.FlagSet) func(context.Context, *sql.DB, string, io.Writer, io.Writer) (int, error) {
	key := keyFlags(fs)
	force := fs.Bool("force", false, "delete a key in flight or under a live lease all the same (its work may still commit: see docs/operations.md)")
	reason := fs.String("reason", "", "why, for the audit log line (a ticket, an incident)")
	actor := fs.String("actor", os.Getenv("USER"), "who asks, for the audit log line")
	asJSON := fs.Bool("json", false, "print what was removed as one JSON document (docs/operations.md)")
	return func(ctx context.Context, db *sql.DB, table string, stdout, stderr io.Writer) (int, error) {
		k, err := key()
		if err != nil {
			return 0, err
		}
		f, err := idemops.ForgetKey(ctx, db, idemops.ForgetOptions{
			Table: table, Key: k, Force: *force, Reason: *reason, Actor: *actor,
			Logger: slog.New(slog.NewTextHandler(stderr, nil)),
		})
		switch {
		case errors.Is(err, idemops.ErrKeyNotFound):
			return notFound(stdout, *asJSON, k)
		case errors.Is(err, idemops.ErrKeyInFlight), errors.Is(err, idemops.ErrLeaseLive):
			if *asJSON {
				_ = writeJSON(stdout, map[string]any{"removed": false, "refused": oneLine(err), "source": k.Source, "event_id": k.EventID})
			}
			fmt.Fprintf(stderr, "idem keys forget: refused: %s\n", oneLine(err))
			return exitRefused, nil
		case err != nil:
			return 0, err
		}
		if *asJSON {
			return exitOK, writeJSON(stdout, forgottenDoc{Removed: true, Forced: f.Forced, Key: keyJSON(&f.KeyInfo, false)})
		}
		forced := ""
		if f.Forced {
			forced = " (forced)"
		}
		fmt.Fprintf(stdout, "forgot key source %q event_id %q%s: it was %s, claimed %s", k.Source, k.EventID, forced, f.State, stamp(f.ClaimedAt))
		if f.Status != 0 {
			fmt.Fprintf(stdout, ", answered %d", f.Status)
		}
		fmt.Fprintln(stdout, "; its next delivery runs the handler")
		return exitOK, nil
	}
}

// keyInfoDoc is a key in keys show -json, keys list -json and keys
// forget -json.
type keyInfoDoc struct {
	Found       bool                `json:"found"`
	Source      string              `json:"source"`
	EventID     string              `json:"event_id"`
	State       string              `json:"state"`
	CheckedAt   string              `json:"checked_at"`
	ClaimedAt   *string             `json:"claimed_at"`
	CompletedAt *string             `json:"completed_at"`
	LeaseUntil  *string             `json:"lease_until"`
	Status      *int                `json:"status"`
	Headers     map[string][]string `json:"headers"`
	BodyBytes   int                 `json:"body_bytes"`
	Body        *string             `json:"body,omitempty"`
	BodyBase64  []byte              `json:"body_base64,omitempty"`
	Digest      string              `json:"request_sha256"`
	Partition   *string             `json:"partition"`
	LockHolder  *int                `json:"lock_holder_pid"`
}

type forgottenDoc struct {
	Removed bool       `json:"removed"`
	Forced  bool       `json:"forced"`
	Key     keyInfoDoc `json:"key"`
}

func keyJSON(k *idemops.KeyInfo, withBody bool) keyInfoDoc {
	d := keyInfoDoc{
		Found: true, Source: k.Key.Source, EventID: k.Key.EventID, State: k.State.String(),
		CheckedAt: stamp(k.CheckedAt), ClaimedAt: stampOrNull(k.ClaimedAt), CompletedAt: stampOrNull(k.CompletedAt),
		LeaseUntil: stampOrNull(k.LeaseUntil), Headers: map[string][]string{}, BodyBytes: k.BodySize, Digest: k.PayloadDigest,
	}
	if k.Status != 0 {
		d.Status = &k.Status
	}
	for n, v := range k.Headers {
		d.Headers[n] = v
	}
	if withBody {
		if utf8.Valid(k.Body) {
			s := string(k.Body)
			d.Body = &s
		} else {
			d.BodyBase64 = k.Body
		}
	}
	if k.Partition != "" {
		d.Partition = &k.Partition
	}
	if k.InFlight {
		d.LockHolder = &k.HolderPID
	}
	return d
}

// printable is a stored body as a terminal may show it: control characters
// other than newline and tab (which could move the cursor or retitle the
// window: the body is whatever a sender's handler answered) become \xNN.
func printable(b []byte) string {
	var out strings.Builder
	for _, r := range string(b) {
		switch {
		case r == '\n' || r == '\t':
			out.WriteRune(r)
		case r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0):
			fmt.Fprintf(&out, "\\x%02x", r)
		default:
			out.WriteRune(r)
		}
	}
	return out.String()
}
