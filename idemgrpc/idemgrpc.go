// Package idemgrpc makes unary gRPC methods exactly-once with idem: a
// retried call with the same idempotency key gets the stored response, and
// the handler's database writes commit once, together with it.
//
//	mw, err := idem.New(db, idem.Options{}) // or idempgx.New(pool, ...); no KeyFunc needed
//	...
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
//		recovery, // a panic goes on from idem after the rollback
//		idemgrpc.UnaryServerInterceptor(mw, idemgrpc.WithCaller(callerFromAuth)),
//	))
//
// and in a handler:
//
//	tx, ok := idem.Tx(ctx) // idempgx.Tx(ctx) with idempgx
//
// The interceptor is built on idem's Middleware.Do (docs/consumers.md): the
// key is claimed in a transaction, the handler runs inside it (its writes go
// through idem.Tx or idempgx.Tx), and its response, marshalled, commits
// with the claim and the writes. A retry of the same key and the same
// request message gets the stored response, with the response header
// metadata idempotent-replayed: true, and the handler does not run.
//
// Streaming RPCs are not covered: UnaryServerInterceptor sees only unary
// calls, and streams pass through untouched. See docs/grpc.md for the
// status codes of each outcome.
package idemgrpc

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
)

// MetadataKey is the request metadata entry that carries the idempotency
// key, with the syntax of the HTTP Idempotency-Key header (a bare token or
// a quoted string; see idem.ParseIdempotencyKey).
const MetadataKey = "idempotency-key"

// ReplayedKey is the response header metadata entry set, to "true", on a
// replayed response.
const ReplayedKey = "idempotent-replayed"

// DefaultRetryDelay is the retry delay that Aborted and Unavailable answers
// carry (google.rpc.RetryInfo) when neither WithRetryDelay nor the
// middleware (Result.RetryAfter) gives one.
const DefaultRetryDelay = time.Second

// typeURLPrefix is the prefix of a stored response's type URL, as in
// anypb.New.
const typeURLPrefix = "type.googleapis.com/"

// errorTypeURL marks a stored final error (a google.rpc.Status). It is not
// a type.googleapis.com URL, so no response type can be mistaken for it.
const errorTypeURL = "idemgrpc/error/google.rpc.Status"

// Option configures UnaryServerInterceptor.
type Option func(*config)

type config struct {
	caller       func(ctx context.Context) (string, error)
	singleTenant bool
	keyField     protoreflect.Name
	requireKey   bool
	finalCodes   map[codes.Code]bool
	retryDelay   time.Duration
	methods      map[string]bool
}

// WithCaller sets how the caller of a call is told from its context: the
// authenticated principal (a tenant, a client certificate's subject, a
// token's subject), which scopes the key with the full method name, so two
// callers never read each other's stored responses or collide on a key.
// An error from f is returned to the client as it is when it is a gRPC
// status error, and as Unauthenticated (without its text) otherwise; an
// empty caller is refused with Unauthenticated. f runs only for calls that
// carry a key. WithCaller or SingleTenant is required.
func WithCaller(f func(ctx context.Context) (string, error)) Option {
	return func(c *config) { c.caller = f }
}

// SingleTenant states that all callers share one scope per method: a key
// sent by one client is the same key for any other. Use it for a service
// with one client, or whose callers are not told apart; otherwise use
// WithCaller.
func SingleTenant() Option {
	return func(c *config) { c.singleTenant = true }
}

// WithKeyField takes the key from the request message's string field of
// that name (Google AIP-155's request_id) instead of the idempotency-key
// metadata entry. A message without the field, or with an empty one, has
// no key. The field's value is checked as a key's event id (1 to 255 bytes
// of UTF-8 without control characters), not as a header.
func WithKeyField(name string) Option {
	return func(c *config) { c.keyField = protoreflect.Name(name) }
}

// RequireKey refuses calls without a key with InvalidArgument. Without it,
// they pass through to the handler untouched, outside any transaction
// (idem.Tx reports false).
func RequireKey() Option {
	return func(c *config) { c.requireKey = true }
}

// WithFinalCodes makes the handler errors with these codes final, as
// idem.Options.FinalStatus does for HTTP statuses: the error's status
// (code, message and details) is stored and committed with the handler's
// writes, and replayed to every retry of the key, without running the
// handler. By default no error is final: a handler error rolls back the
// claim and the handler's writes, and a retry runs the handler again.
// codes.OK is ignored.
func WithFinalCodes(cs ...codes.Code) Option {
	return func(c *config) {
		if c.finalCodes == nil {
			c.finalCodes = map[codes.Code]bool{}
		}
		for _, code := range cs {
			if code != codes.OK {
				c.finalCodes[code] = true
			}
		}
	}
}

// WithRetryDelay sets the retry delay carried, as google.rpc.RetryInfo, by
// Aborted answers (the key is in flight) and Unavailable ones. 0 or less
// (the default) means the middleware's (idem.Result.RetryAfter): for a key
// whose lease-mode original is still running (idem.Options.Lease), the
// lease's time left, else idem.Options.RetryAfter (1 s by default).
func WithRetryDelay(d time.Duration) Option {
	return func(c *config) { c.retryDelay = d }
}

// WithMethods limits the interceptor to these full method names
// ("/package.Service/Method"); other methods pass through untouched. By
// default every unary method is covered.
func WithMethods(fullMethods ...string) Option {
	return func(c *config) {
		if c.methods == nil {
			c.methods = map[string]bool{}
		}
		for _, m := range fullMethods {
			c.methods[m] = true
		}
	}
}

// UnaryServerInterceptor returns an interceptor that runs each unary call
// carrying a key at most once to completion, through mw.Do:
//
//   - the key is the idempotency-key metadata entry (or the field that
//     WithKeyField names), scoped by the full method name and the caller
//     (WithCaller, or SingleTenant);
//   - the payload whose digest is stored with the key is the request
//     message marshalled deterministically, so a retry of a message with a
//     map field is the same payload;
//   - the handler runs in the claim's transaction (idem.Tx, idempgx.Tx),
//     with a context detached from the client's cancellation and deadline
//     (mw's HandlerTimeout bounds it instead), so a client that gives up
//     does not undo work that a retry will be answered with;
//   - a response is stored as its marshalled bytes and its type URL; a
//     replay unmarshals it into a new message of that type (resolved in
//     protoregistry.GlobalTypes), which marshals to the same bytes, and
//     sets the header idempotent-replayed: true.
//
// Calls without a key pass through untouched, or are refused (RequireKey).
// Status errors are documented in docs/grpc.md; no status message carries
// an internal error's text. UnaryServerInterceptor panics when mw is nil or
// neither WithCaller nor SingleTenant is given (one of them is required).
func UnaryServerInterceptor(mw *idem.Middleware, opts ...Option) grpc.UnaryServerInterceptor {
	if mw == nil {
		panic("idemgrpc: UnaryServerInterceptor needs a Middleware")
	}
	c := &config{}
	for _, o := range opts {
		o(c)
	}
	switch {
	case c.caller == nil && !c.singleTenant:
		panic("idemgrpc: UnaryServerInterceptor needs WithCaller, or SingleTenant when all callers share one scope")
	case c.caller != nil && c.singleTenant:
		panic("idemgrpc: WithCaller and SingleTenant exclude each other")
	}
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if c.methods != nil && !c.methods[info.FullMethod] {
			return handler(ctx, req)
		}
		return c.intercept(ctx, mw, req, info.FullMethod, handler)
	}
}

func (c *config) intercept(ctx context.Context, mw *idem.Middleware, req any, method string, handler grpc.UnaryHandler) (any, error) {
	msg, isProto := req.(proto.Message)
	eventID, err := c.key(ctx, msg)
	switch {
	case err != nil:
		return nil, err
	case eventID == "" && c.requireKey:
		return nil, status.Errorf(codes.InvalidArgument, "idempotency key required: send it in the %s", c.keyPlace())
	case eventID == "":
		return handler(ctx, req)
	case !isProto:
		return nil, status.Error(codes.Internal, "idempotency: the request is not a protocol buffers message")
	}
	source := method
	if !c.singleTenant {
		who, err := c.caller(ctx)
		if err != nil {
			if _, ok := status.FromError(err); ok {
				return nil, err
			}
			return nil, status.Error(codes.Unauthenticated, "the caller could not be identified")
		}
		if who == "" {
			return nil, status.Error(codes.Unauthenticated, "the caller could not be identified")
		}
		// A method name holds no space, so the first space ends it.
		source = method + " " + who
	}
	payload, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, "the request message cannot be marshalled")
	}

	var (
		fresh   any   // the handler's response, when it ran and succeeded
		herr    error // the handler's error, when not final
		badResp bool  // the handler's response cannot be stored
	)
	res, err := mw.Do(context.WithoutCancel(ctx), idem.Key{Source: source, EventID: eventID}, payload, func(ctx context.Context) ([]byte, error) {
		resp, err := handler(ctx, req)
		if err != nil {
			st := status.Convert(err)
			if !c.finalCodes[st.Code()] {
				herr = err
				return nil, err
			}
			herr = err // returned as is this time
			v, merr := proto.Marshal(st.Proto())
			if merr != nil {
				badResp = true
				return nil, merr
			}
			return proto.Marshal(&anypb.Any{TypeUrl: errorTypeURL, Value: v})
		}
		m, ok := resp.(proto.Message)
		if !ok || m == nil {
			badResp = true
			return nil, errors.New("idemgrpc: the response is not a protocol buffers message")
		}
		v, merr := proto.MarshalOptions{Deterministic: true}.Marshal(m)
		if merr != nil {
			badResp = true
			return nil, merr
		}
		fresh = resp
		return proto.Marshal(&anypb.Any{TypeUrl: typeURLPrefix + string(m.ProtoReflect().Descriptor().FullName()), Value: v})
	})
	switch {
	case err == nil && !res.Replayed:
		if fresh != nil {
			return fresh, nil
		}
		return nil, herr // a final error, stored
	case err == nil:
		_ = grpc.SetHeader(ctx, metadata.Pairs(ReplayedKey, "true"))
		return replay(res.Value)
	case badResp:
		return nil, status.Error(codes.Internal, "idempotency: the response cannot be stored")
	}
	return nil, c.statusOf(err, herr, res.RetryAfter)
}

// key returns the call's event id, "" when it has none.
func (c *config) key(ctx context.Context, msg proto.Message) (string, error) {
	if c.keyField != "" {
		if msg == nil {
			return "", nil
		}
		m := msg.ProtoReflect()
		fd := m.Descriptor().Fields().ByName(c.keyField)
		if fd == nil || fd.Kind() != protoreflect.StringKind || fd.IsList() || fd.IsMap() {
			return "", nil
		}
		return m.Get(fd).String(), nil
	}
	vs := metadata.ValueFromIncomingContext(ctx, MetadataKey)
	switch {
	case len(vs) == 0 || (len(vs) == 1 && strings.Trim(vs[0], " \t") == ""):
		return "", nil
	case len(vs) > 1:
		return "", status.Errorf(codes.InvalidArgument, "invalid idempotency key: %s is sent more than once", MetadataKey)
	}
	k, err := idem.ParseIdempotencyKey(vs[0])
	if err != nil {
		// The parser's text names the syntax rule, never the value.
		return "", status.Error(codes.InvalidArgument, strings.Replace(err.Error(), "Idempotency-Key", MetadataKey, 1))
	}
	return k, nil
}

// keyPlace says where a call's key is read from.
func (c *config) keyPlace() string {
	if c.keyField != "" {
		return string(c.keyField) + " field of the request message"
	}
	return MetadataKey + " metadata entry"
}

// replay turns a stored value back into the response or the final error.
func replay(value []byte) (any, error) {
	var a anypb.Any
	if err := proto.Unmarshal(value, &a); err != nil {
		return nil, status.Error(codes.Internal, "idempotency: the stored response cannot be read")
	}
	if a.TypeUrl == errorTypeURL {
		var s spb.Status
		if err := proto.Unmarshal(a.Value, &s); err != nil {
			return nil, status.Error(codes.Internal, "idempotency: the stored response cannot be read")
		}
		return nil, status.FromProto(&s).Err()
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByURL(a.TypeUrl)
	if err != nil {
		return nil, status.Error(codes.Internal, "idempotency: the stored response's type is not known to this server")
	}
	m := mt.New().Interface()
	if err := proto.Unmarshal(a.Value, m); err != nil {
		return nil, status.Error(codes.Internal, "idempotency: the stored response cannot be read")
	}
	return m, nil
}

// statusOf maps an error of Do, other than a committed answer, to the
// status the client gets (docs/grpc.md has the table).
func (c *config) statusOf(err, herr error, retryAfter time.Duration) error {
	delay := c.retryDelay
	switch {
	case delay > 0:
	case retryAfter > 0:
		delay = retryAfter
	default:
		delay = DefaultRetryDelay
	}
	switch {
	case errors.Is(err, idem.ErrHandlerTimeout):
		return retryable(codes.Unavailable, "idempotency: the handler ran past its time limit and was rolled back; retry", delay)
	case herr != nil && errors.Is(err, herr):
		return herr // the handler's own error, rolled back
	case errors.Is(err, idem.ErrInvalidKey):
		return status.Error(codes.InvalidArgument, "invalid idempotency key (or scope): each part must be 1 to 255 bytes of UTF-8 without control characters")
	case errors.Is(err, idem.ErrBodyTooLarge):
		return status.Error(codes.ResourceExhausted, "idempotency: the request message is larger than the idempotency store accepts")
	case errors.Is(err, idem.ErrPayloadMismatch):
		return status.Error(codes.FailedPrecondition, "idempotency key reused with a different request message")
	case errors.Is(err, idem.ErrInFlight):
		return retryable(codes.Aborted, "an earlier call with this idempotency key is still in progress; retry", delay)
	case errors.Is(err, idem.ErrConflict), errors.Is(err, idem.ErrLeaseExpired):
		return retryable(codes.Aborted, "idempotency: the call lost a concurrent claim of its key; retry", delay)
	case errors.Is(err, idem.ErrUnavailable):
		return retryable(codes.Unavailable, "idempotency store unavailable; retry", delay)
	case errors.Is(err, idem.ErrResponseTooLarge):
		return status.Error(codes.ResourceExhausted, "idempotency: the response is larger than the idempotency store accepts")
	case errors.Is(err, idem.ErrTxAborted):
		return status.Error(codes.Internal, "idempotency: the handler succeeded after one of its statements failed; rolled back")
	case errors.Is(err, idem.ErrTxMisuse):
		return status.Error(codes.Internal, "idempotency: the handler ended the transaction itself")
	}
	return status.Error(codes.Internal, "idempotency: internal error")
}

// retryable is a status with google.rpc.RetryInfo.
func retryable(code codes.Code, msg string, delay time.Duration) error {
	st, err := status.New(code, msg).WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(delay)})
	if err != nil {
		return status.Error(code, msg)
	}
	return st.Err()
}
