// Command idemui builds the operator UI with idemui: its New reads the
// table, which the offline database refuses, and says so.
package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/pgidem/idem/idemui"
)

func main() {
	_, err := idemui.New(offlineDB(), idemui.Options{})
	if err == nil || !strings.Contains(err.Error(), "offline") {
		fmt.Println("idemui: New should report the offline database, got", err)
		os.Exit(1)
	}
	fmt.Println("idemui: New reports the database:", err)
}
