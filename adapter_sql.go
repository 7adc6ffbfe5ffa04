package idem

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/summary"
)

// sqlPool is the database/sql adapter (driver.Pool): each statement is a
// round trip of its own, sent on the claim's *sql.Tx or, outside a
// transaction, on any connection of the *sql.DB. It decides nothing:
// package claims does.
type sqlPool struct{ db *sql.DB }

// Acquire takes no connection yet: database/sql takes one for the
// transaction when it begins, or for each statement outside one.
func (p sqlPool) Acquire(context.Context) (driver.Conn, error) { return &sqlConn{db: p.db}, nil }

func (p sqlPool) Pipelines() bool { return false }

func (p sqlPool) Cap() int { return p.db.Stats().MaxOpenConnections }

func (p sqlPool) Query(ctx context.Context, query string, args []any, each func(func(...any) error) error) error {
	rows, err := p.db.QueryContext(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	return summary.EachRow(rows, each)
}

// sqlConn is a claim's statements on database/sql: conn, taken from the
// pool within ctx when a transaction begins, and tx while it is open.
type sqlConn struct {
	db   *sql.DB
	conn *sql.Conn
	tx   *sql.Tx
}

func (c *sqlConn) Handle() any { return c.tx }

// sqlQuerier is what runs a statement: a *sql.Tx, *sql.Conn or *sql.DB.
type sqlQuerier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// Send sends b's statements one by one. A transaction's connection is
// taken within ctx, but the transaction begins on a context that does not
// end, because database/sql sends COMMIT on the context a transaction
// began with, through pgx, which cancels a query whose context ends, and a
// COMMIT must never be cancelled (driver.Batch.Commit); that also spares
// database/sql a goroutine watching it. Every statement is sent with ctx,
// and COMMIT only while ctx lasts.
func (c *sqlConn) Send(ctx context.Context, b *driver.Batch) error {
	err := c.send(ctx, b)
	if errors.Is(err, sql.ErrTxDone) { // the handler ended the transaction
		err = fmt.Errorf("%w: %w: %w", driver.ErrTxDone, driver.ErrTxEnded, err)
	}
	return err
}

func (c *sqlConn) send(ctx context.Context, b *driver.Batch) error {
	if b.Begin != nil {
		if c.conn == nil {
			conn, err := c.db.Conn(ctx) // waiting for a connection ends with ctx
			if err != nil {
				return err
			}
			c.conn = conn
		}
		tx, err := c.conn.BeginTx(context.WithoutCancel(ctx), b.Begin)
		if err != nil {
			return err
		}
		c.tx = tx
	}
	for i := range b.Stmts {
		if err := c.run(ctx, &b.Stmts[i], b.Commit); err != nil {
			return err
		}
	}
	switch {
	case c.tx == nil:
		return nil
	case b.Commit:
		if err := ctx.Err(); err != nil {
			return err // the deadline passed: the engine rolls back
		}
		tx, conn := c.tx, c.conn
		c.tx, c.conn = nil, nil // a driver that panics in COMMIT leaves conn locked: not closed then
		err := tx.Commit()
		c.conn = conn
		return err
	case b.Rollback:
		return c.Close(ctx)
	}
	return nil
}

// run sends one statement: in the transaction; outside one, on any
// connection, or, when it commits (a statement of a committing batch), on
// a connection taken within ctx and sent on a context that does not end.
func (c *sqlConn) run(ctx context.Context, s *driver.Stmt, commits bool) error {
	var q sqlQuerier = c.db
	switch {
	case c.tx != nil:
		q = c.tx
	case commits:
		conn, err := c.db.Conn(ctx)
		if err != nil {
			return err
		}
		defer conn.Close()
		q, ctx = conn, context.WithoutCancel(ctx)
	}
	if s.Dest == nil {
		res, err := q.ExecContext(ctx, s.SQL, s.Args...)
		if err == nil {
			s.N, err = res.RowsAffected()
		}
		return err
	}
	err := q.QueryRowContext(ctx, s.SQL, s.Args...).Scan(s.Dest...)
	if errors.Is(err, sql.ErrNoRows) {
		s.NoRow, err = true, nil
	}
	return err
}

// Close rolls back the transaction, if one is open, and gives the
// connection back to the pool. A rollback that failed for a lost
// connection wraps driver.ErrConnLost.
func (c *sqlConn) Close(context.Context) error {
	var err error
	if tx := c.tx; tx != nil {
		c.tx = nil
		switch err = tx.Rollback(); {
		case errors.Is(err, sql.ErrTxDone):
			err = nil
		case driver.ConnLost(err):
			err = fmt.Errorf("%w: %w", driver.ErrConnLost, err)
		}
	}
	if conn := c.conn; conn != nil {
		c.conn = nil
		err = errors.Join(err, conn.Close())
	}
	return err
}
