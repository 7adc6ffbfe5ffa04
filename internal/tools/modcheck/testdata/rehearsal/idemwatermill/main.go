// Command idemwatermill runs a handler wrapped by idemwatermill's
// middleware on a message without a UUID, which it refuses as a permanent
// error before any claim: no broker and no database are needed.
package main

import (
	"fmt"
	"os"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemwatermill"
)

func main() {
	mw, err := idem.New(offlineDB(), options())
	check(err)
	exactlyOnce, err := idemwatermill.Middleware(mw)
	check(err)
	h := exactlyOnce(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	_, err = h(message.NewMessage("", []byte(`{}`)))
	fmt.Println("idemwatermill:", idemwatermill.IsPermanent(err))
	if !idemwatermill.IsPermanent(err) {
		os.Exit(1)
	}
}
