package idemwatermill_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idempgx"
	"github.com/pgidem/idem/idemwatermill"
)

// app is the tests' consumer: its handler writes the message to the ledger
// in idem's transaction, counts its run in the runs table outside it, and
// produces one message with a new UUID and the payload "done:<payload>".
// A payload starting with one of these words changes what it does:
//
//	fail-once   returns an error on its first run for a UUID
//	panic-once  panics on its first run for a UUID
//	permanent   returns an error marked idemwatermill.Permanent
//
// crash, for the consumer processes, kills the process with SIGKILL on the
// handler's first run: "before-commit" after its writes, "after-commit"
// after idem's COMMIT, before the router publishes and acks.
type app struct {
	db     *sql.DB
	ns     names
	crash  string
	mu     sync.Mutex
	failed map[string]bool
}

func (a *app) handle(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	body := string(msg.Payload)
	produced := watermill.NewUUID()
	if _, err := a.db.ExecContext(ctx, `INSERT INTO `+a.ns.runs+` (event_id, produced, pid) VALUES ($1, $2, $3)`,
		msg.UUID, produced, os.Getpid()); err != nil {
		return nil, err
	}
	if err := a.write(ctx, msg.UUID, body); err != nil {
		return nil, err
	}
	switch {
	case a.crash == "before-commit":
		kill()
	case strings.HasPrefix(body, "permanent"):
		return nil, idemwatermill.Permanent(errors.New("cannot parse the message"))
	case strings.HasPrefix(body, "fail-once") && a.first(msg.UUID):
		return nil, errors.New("the handler failed")
	case strings.HasPrefix(body, "panic-once") && a.first(msg.UUID):
		panic("the handler panicked")
	}
	out := message.NewMessage(produced, []byte("done:"+body))
	out.Metadata.Set("event", msg.UUID)
	return []*message.Message{out}, nil
}

// first reports whether this is the first call for uuid.
func (a *app) first(uuid string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.failed[uuid] {
		return false
	}
	if a.failed == nil {
		a.failed = map[string]bool{}
	}
	a.failed[uuid] = true
	return true
}

// write appends the message to the ledger through idem's transaction.
func (a *app) write(ctx context.Context, uuid, body string) error {
	q := `INSERT INTO ` + a.ns.ledger + ` (event_id, body) VALUES ($1, $2)`
	if tx, ok := idem.Tx(ctx); ok {
		_, err := tx.ExecContext(ctx, q, uuid, body)
		return err
	}
	if tx, ok := idempgx.Tx(ctx); ok {
		_, err := tx.Exec(ctx, q, uuid, body)
		return err
	}
	return errors.New("not inside idem's Do")
}

// afterCommit kills the process, for crash "after-commit", once idem's
// middleware has committed: before the router publishes and acks.
func (a *app) afterCommit(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err == nil && a.crash == "after-commit" {
			kill()
		}
		return out, err
	}
}

// kill ends the process as a crash would: SIGKILL, nothing cleaned up.
func kill() {
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

// newRouter builds the consumer's router on RabbitMQ: the handler "ledger"
// on ns.in, its messages published to ns.out, the poison queue ns.poison
// taking idemwatermill's permanent errors. With handlers > 1, that many
// handlers "ledger-<i>" compete for ns.in, sharing their keys (WithSource).
// The caller runs and closes it; closers are closed after it.
func newRouter(a *app, mw *idem.Middleware, quorum bool, handlers int, wlog watermill.LoggerAdapter, opts ...idemwatermill.Option) (r *message.Router, closers []func() error, err error) {
	defer func() {
		if err != nil {
			for _, c := range closers {
				_ = c()
			}
		}
	}()
	pub, err := wamqp.NewPublisher(amqpConfig(nil), wlog)
	if err != nil {
		return nil, nil, err
	}
	closers = append(closers, pub.Close)
	sub, err := wamqp.NewSubscriber(amqpConfig(inArgs(quorum, a.ns.dead)), wlog)
	if err != nil {
		return nil, closers, err
	}
	closers = append(closers, sub.Close)
	poison, err := middleware.PoisonQueueWithFilter(pub, a.ns.poison, idemwatermill.IsPermanent)
	if err != nil {
		return nil, closers, err
	}
	if handlers > 1 {
		opts = append(opts, idemwatermill.WithSource("ledger"))
	}
	exactlyOnce, err := idemwatermill.Middleware(mw, opts...)
	if err != nil {
		return nil, closers, err
	}
	r, err = message.NewRouter(message.RouterConfig{}, wlog)
	if err != nil {
		return nil, closers, err
	}
	r.AddMiddleware(poison, a.afterCommit, exactlyOnce)
	if handlers <= 1 {
		r.AddHandler("ledger", a.ns.in, sub, a.ns.out, pub, a.handle)
	} else {
		for i := range handlers {
			r.AddHandler(fmt.Sprintf("ledger-%d", i), a.ns.in, sub, a.ns.out, pub, a.handle)
		}
	}
	return r, closers, nil
}
