// Command otel receives webhooks with one trace per delivery that shows the
// HTTP request (otelhttp), idem's decision and its phases (idemotel), and
// the SQL (otelpgx, in pgx's tracer slot): spans go to stdout, or over OTLP
// when OTEL_EXPORTER_OTLP_ENDPOINT is set; metrics, idem's and otelhttp's,
// are served for Prometheus at /metrics.
//
//	go run ./otel
//	curl -i -X POST -H 'X-Event-Id: evt_1' -d '{"amount":2000}' http://127.0.0.1:8080/webhooks/orders
//	curl -s http://127.0.0.1:8080/metrics | grep '^idem_'
//
// Send the POST twice: the second trace's span "idem orders POST
// /webhooks/orders" says idem.outcome=replayed, with the claim's SQL under
// it and no handler. The keys here come from a header, for a curl; a real
// webhook endpoint uses a verifying preset (see ../stripe).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"os/signal"
	"syscall"

	"github.com/exaring/otelpgx"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/internal/example"
	"github.com/pgidem/idem/idemotel"
	"github.com/pgidem/idem/idempgx"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8080", "address to listen on")
	dsn := flag.String("database-url", "", example.DatabaseURLUsage)
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("otel: ")

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *dsn == "" {
		*dsn = example.DatabaseURL()
	}
	if err := run(ctx, *addr, *dsn); err != nil {
		log.Print(err)
		stop()
		os.Exit(1)
	}
}

func run(ctx context.Context, addr, dsn string) error {
	tel, err := newTelemetry(ctx, os.Stdout)
	if err != nil {
		return err
	}
	defer tel.shutdown(context.Background())
	pool, err := newPool(ctx, dsn, tel.tp)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrate(ctx, pool); err != nil {
		return err
	}
	h, err := newServer(pool, tel)
	if err != nil {
		return err
	}
	return example.Serve(ctx, addr, h)
}

// telemetry is the service's providers: a tracer provider exporting to
// OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set, else to out; a meter
// provider read by the Prometheus registry that /metrics serves.
type telemetry struct {
	tp       *sdktrace.TracerProvider
	mp       *sdkmetric.MeterProvider
	registry *prometheus.Registry
}

func newTelemetry(ctx context.Context, out io.Writer) (*telemetry, error) {
	var exp sdktrace.SpanExporter
	var err error
	if os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" {
		exp, err = otlptracehttp.New(ctx) // reads the OTEL_EXPORTER_OTLP_* variables
	} else {
		exp, err = stdouttrace.New(stdouttrace.WithWriter(out), stdouttrace.WithPrettyPrint())
	}
	if err != nil {
		return nil, err
	}
	registry := prometheus.NewRegistry()
	reader, err := otelprom.New(otelprom.WithRegisterer(registry))
	if err != nil {
		return nil, err
	}
	return &telemetry{
		tp:       sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp)),
		mp:       sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
		registry: registry,
	}, nil
}

// shutdown flushes the spans still batched, and stops the providers.
func (t *telemetry) shutdown(ctx context.Context) error {
	return errors.Join(t.tp.Shutdown(ctx), t.mp.Shutdown(ctx))
}

// newPool opens a pool whose statements otelpgx traces: pgx has one tracer
// slot (ConnConfig.Tracer); to keep a tracer already set there, combine the
// two with github.com/jackc/pgx/v5/multitracer.
func newPool(ctx context.Context, dsn string, tp *sdktrace.TracerProvider) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("invalid database URL %s: %s", example.Redact(dsn), example.OneLine(err))
	}
	cfg.MaxConns = 10
	cfg.ConnConfig.Tracer = otelpgx.NewTracer(otelpgx.WithTracerProvider(tp))
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("cannot reach PostgreSQL at %s: %s; %s", example.Redact(dsn), example.OneLine(err), example.StartPostgres)
	}
	return pool, nil
}

// migrate creates the idempotency table and the orders table.
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idempgx.Migrate(ctx, pool, ""); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS otel_orders (
		id bigserial PRIMARY KEY, event_id text NOT NULL UNIQUE, body jsonb NOT NULL)`)
	return err
}

// newServer serves POST /webhooks/orders through idem, traced and measured
// by idemotel, inside otelhttp; and GET /metrics.
func newServer(pool *pgxpool.Pool, tel *telemetry) (http.Handler, error) {
	it, err := idemotel.New(idemotel.WithTracerProvider(tel.tp), idemotel.WithMeterProvider(tel.mp))
	if err != nil {
		return nil, err
	}
	mw, err := idempgx.New(pool, idem.Options{
		KeyFunc:  idem.Header("orders", "X-Event-Id"),
		Observer: it.Observe, // idem.Observers(it.Observe, prom.Observe) to feed idemprom too
		OnPhase:  it.OnPhase,
	})
	if err != nil {
		return nil, err
	}
	if _, err := it.Watch(mw); err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /webhooks/orders", mw.Handler(http.HandlerFunc(recordOrder)))
	mux.Handle("GET /metrics", promhttp.HandlerFor(tel.registry, promhttp.HandlerOpts{}))
	return otelhttp.NewHandler(mux, "webhooks",
		otelhttp.WithTracerProvider(tel.tp), otelhttp.WithMeterProvider(tel.mp)), nil
}

// recordOrder stores the order in idem's transaction: its INSERT is a span
// under idem.handler.
func recordOrder(w http.ResponseWriter, r *http.Request) {
	tx, _ := idempgx.Tx(r.Context())
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "cannot read the body", http.StatusBadRequest)
		return
	}
	var id int64
	err = tx.QueryRow(r.Context(), `INSERT INTO otel_orders (event_id, body) VALUES ($1, $2) RETURNING id`,
		r.Header.Get("X-Event-Id"), body).Scan(&id)
	if err != nil {
		http.Error(w, "cannot record the order", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"order_id":%d}`+"\n", id)
}
